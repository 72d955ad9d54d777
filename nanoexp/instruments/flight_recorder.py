"""torch's flight recorder as nanoexp uses it: every process group records its last collectives (op, group, sequence
number, sizes, state, creation time) in a ring of `debug.flight_recorder_entries`; on a stall each rank writes the
ring to `<run>/debug/fr/rank_<N>` in the format torch's analyzer (`torchfrtrace`) reads, a pickle, and the same as
JSON to `<run>/debug/fr_json/rank_<N>.json`, which is what nanoexp's own diagnosis reads: nanoexp decodes only the
pickle torch's recorder hands over in memory, in this process, and never unpickles a file.

torch's analyzer unpickles every file whose name holds the prefix, in subfolders too: run over the run folder, a
file planted there (a shared, copied or resumed run) would run its code. So nanoexp runs it over a private folder of
its own making, holding only the dumps of this stall, pickled again from their JSON (plain data: nothing in them can
run).
Two things are added to what torch writes. gloo leaves the dump's group table (`pg_config`) empty, which the
analyzer needs to match ranks: nanoexp fills it from its own groups (their layout names and global ranks). And under
the key "nanoexp", the rank's heartbeat and, for each recorded collective, the step and action that posted it (from
the heartbeat's history and the record's creation time, both this process's clock).
"""
from __future__ import annotations

import json
import os
import pickle   # torch's dump format: decoded from torch's own bytes in memory, written for torchfrtrace
import shutil
import subprocess
import sys
import tempfile

import torch

from nanoexp.instruments.heartbeat import Heartbeat

PREFIX = "rank_"   # torchfrtrace <folder> -p rank_


def recorder_env(entries: int) -> dict[str, str]:
    """The environment that turns the recorder on; it must be set before the first process group is made."""
    return {"TORCH_FR_BUFFER_SIZE": str(entries)} if entries > 0 else {}


def _raw_trace(backend: str | None) -> bytes:
    c10d = torch._C._distributed_c10d
    if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace"):   # NCCL's recorder is its own instance
        return c10d._dump_nccl_trace()
    return c10d._dump_fr_trace()


def read_trace(backend: str | None, group_table: dict, heartbeat: Heartbeat, rank: int) -> dict:
    """This process's recorder contents, with the group table filled in and each record's step and action."""
    trace = pickle.loads(_raw_trace(backend))
    config = trace.setdefault("pg_config", {})
    for name, (description, ranks) in group_table.items():
        if not config.get(name, {}).get("ranks") or config[name]["ranks"] == "[]":
            config[name] = {"name": name, "desc": description, "ranks": str(list(ranks))}
    places = {entry["record_id"]: heartbeat.place_at(entry["time_created_ns"]) for entry in trace.get("entries", [])}
    trace["nanoexp"] = {"rank": rank, "heartbeat": heartbeat.snapshot(), "places": places}
    return trace


def write_trace(run_debug_folder: str, rank: int, trace: dict) -> str:
    """`fr/rank_<rank>` for torchfrtrace and `fr_json/rank_<rank>.json` for nanoexp; returns the first."""
    for folder, name, mode, write in ((os.path.join(run_debug_folder, "fr"), f"{PREFIX}{rank}", "wb", pickle.dump),
                                      (os.path.join(run_debug_folder, "fr_json"), f"{PREFIX}{rank}.json", "w",
                                       lambda data, f: json.dump(data, f, default=str))):
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        with open(path + ".tmp", mode) as f:
            write(trace, f)
        os.replace(path + ".tmp", path)   # the analysis never reads half a dump
    return os.path.join(run_debug_folder, "fr", f"{PREFIX}{rank}")


def read_dumps(run_debug_folder: str, ranks: list[int]) -> dict[int, dict]:
    """The JSON copies of the dumps of `ranks` (those that dumped in this stall), by rank; nothing else in the
    folder is read. Record ids as JSON gives them: places are keyed by their text. A dump that is not JSON (not
    one nanoexp wrote) counts as none."""
    dumps = {}
    for rank in ranks:
        try:
            with open(os.path.join(run_debug_folder, "fr_json", f"{PREFIX}{rank}.json")) as f:
                dumps[rank] = json.load(f)
        except (OSError, ValueError):
            continue
    return dumps


def torch_analysis(dumps: dict[int, dict], output: str) -> str:
    """torch's analyzer over `dumps` (read_dumps' plain data), into `output`; returns `output`. Best effort: it
    wants every rank's dump. Its input is a fresh folder only this user can read (mkdtemp), removed after."""
    folder = tempfile.mkdtemp(prefix="nanoexp-fr-")
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", folder, "-p", PREFIX,
               "--allow-incomplete-ranks"]
    try:
        for rank, trace in dumps.items():
            with open(os.path.join(folder, f"{PREFIX}{rank}"), "wb") as f:
                pickle.dump(trace, f)
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        text = result.stdout + result.stderr
    except (OSError, subprocess.TimeoutExpired) as error:
        text = f"{' '.join(command)}: {error}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    with open(output, "w") as f:
        f.write(text)
    return output
