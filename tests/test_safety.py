"""Safe by default: nothing unpickled, W&B off and its key never written, no writes outside the run."""
import ast
import os
import pathlib
import pickle
import subprocess
import sys

import pytest

from nanoexp.launch.workers import WorkerFailed
from tests.helpers import FAST, train

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python_sources():
    for folder in ("nanoexp", "scripts", "benchmarks", "hydra_plugins"):
        yield from (ROOT / folder).rglob("*.py")
    yield ROOT / "train.py"


# torch's flight recorder hands its records over as pickle bytes made in the same process: decoded there, and
# written for torch's analyzer; nanoexp reads the JSON copies (nanoexp/instruments/flight_recorder.py).
FLIGHT_RECORDER = ROOT / "nanoexp" / "instruments" / "flight_recorder.py"
# torch.distributed.checkpoint's readers unpickle a DCP folder's .metadata (DCP's own format). nanoexp reads a DCP
# folder in one function, for scripts/convert_from_dcp.py, from the folder a person names on its command line, and
# its .metadata through a restricted unpickler of that file (pickle imported there for that class only).
DCP_READER, DCP_READER_FUNCTION = ROOT / "nanoexp" / "interop" / "dcp.py", "read_dcp"
DCP_READS = ("dcp.load", "dcp.load_state_dict", "torch.distributed.checkpoint.load",
             "torch.distributed.checkpoint.load_state_dict")
DCP_READ_PARTS = ("FileSystemReader", "read_metadata", "dcp_to_torch_save", "torch_save_to_dcp")
# Modules that read pickles (or run code from files) however they are called.
UNPICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
# torch's flight-recorder analyzer: it unpickles every file in its folder (subfolders too) whose name holds the prefix.
ANALYZER = "torch.distributed.flight_recorder"


def dotted(node: ast.AST) -> str:
    """`a.b.c` of a call's function (the names as written; "" for anything else)."""
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def keyword(call: ast.Call, name: str):
    """A keyword argument's constant value; `missing` when absent, `unknown` when not a constant."""
    value = next((k.value for k in call.keywords if k.arg == name), None)
    if value is None:
        return "missing"
    return value.value if isinstance(value, ast.Constant) else "unknown"


def unpickling_calls(path: pathlib.Path, text: str | None = None) -> list[str]:
    """Every call or import in `path` (or `text`, as if it were that file) that could unpickle a file, as
    'path:line: what'."""
    found, tree = [], ast.parse(path.read_text() if text is None else text, str(path))
    exempt = {id(node) for function in ast.walk(tree) if path == DCP_READER and isinstance(function, ast.FunctionDef)
              and function.name == DCP_READER_FUNCTION for node in ast.walk(function)}
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            modules = []
        for module in modules:
            exempt_import = path in (FLIGHT_RECORDER, DCP_READER) and module == "pickle"
            if module.split(".")[0] in UNPICKLERS and not exempt_import:
                found.append(f"{where}: import {module}")
            if module.startswith(ANALYZER) or module in ("torch.load", "numpy.load", "torch.serialization.load",
                                                         "pandas.read_pickle"):
                found.append(f"{where}: import {module}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(ANALYZER) \
                and path != FLIGHT_RECORDER:
            found.append(f"{where}: runs torch's flight-recorder analyzer")
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name.split(".")[0] in UNPICKLERS and name.split(".")[-1] in ("load", "loads", "Unpickler", "open"):
            if not (path == FLIGHT_RECORDER and name == "pickle.loads" and dotted(node.args[0].func) == "_raw_trace"):
                found.append(f"{where}: {name}")
        if (name in DCP_READS or name.split(".")[-1] in DCP_READ_PARTS) and id(node) not in exempt:
            found.append(f"{where}: {name} (reads a DCP folder: unpickles its .metadata)")
        if name.endswith("read_pickle") or name in ("torch.serialization.load", "torch.jit.load"):
            found.append(f"{where}: {name}")
        if name == "torch.load" and keyword(node, "weights_only") is not True:
            found.append(f"{where}: torch.load without weights_only=True")
        if name in ("np.load", "numpy.load") and keyword(node, "allow_pickle") not in ("missing", False):
            found.append(f"{where}: {name} with allow_pickle")
    return found


def test_no_unpickling_anywhere():
    """Checkpoints and data are read with safetensors, JSON, numpy memmaps or weights_only loads; the one pickle
    decoded is torch's flight recorder's, in memory; torch's analyzer runs only over a folder nanoexp made."""
    found = [line for path in python_sources() for line in unpickling_calls(path)]
    assert not found, found
    assert "pickle.loads(_raw_trace(" in FLIGHT_RECORDER.read_text()   # the scan's one exception is still that


def test_the_dcp_reader_uses_pickle_only_for_its_restricted_unpickler():
    """In the DCP reader's file, pickle serves one class: a pickle.Unpickler whose find_class admits DCP's classes
    (tests/test_dcp.py reads torch's folders through it and sees crafted ones refused), and the error it raises."""
    tree = ast.parse(DCP_READER.read_text())
    uses = {dotted(node) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and dotted(node).startswith("pickle.")}
    assert uses == {"pickle.Unpickler", "pickle.UnpicklingError"}, uses
    [unpickler] = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                   and any(dotted(base) == "pickle.Unpickler" for base in node.bases)]
    assert "find_class" in {f.name for f in unpickler.body if isinstance(f, ast.FunctionDef)}


def test_the_scan_finds_each_way_to_unpickle():
    """The scan above would fail on any of these coming back."""
    cases = ["torch.load(os.path.join(run_dir, 'x.pt'))", "torch.load(p, weights_only=False)",
             "np.load(os.path.join(a, b), allow_pickle=True)", "pickle.load(f)", "import dill",
             "from pickle import load", "subprocess.run([sys.executable, '-m', "
             "'torch.distributed.flight_recorder.fr_trace', run_dir])", "import joblib; joblib.load(p)",
             "pd.read_pickle(p)", "from torch.distributed.flight_recorder.components.loader import read_dir",
             "dcp.load(state, checkpoint_id=run_dir)", "FileSystemReader(folder).read_metadata()",
             "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(a, b)"]
    for case in cases:
        assert unpickling_calls(ROOT / "nanoexp" / "launch" / "watchdog.py", case), case
    # The DCP exception is one function of one file: the same read anywhere else in that file is found.
    assert unpickling_calls(DCP_READER, "def read_dcp(f):\n    dcp.load({}, checkpoint_id=f)") == []
    assert unpickling_calls(DCP_READER, "def resume(f):\n    dcp.load({}, checkpoint_id=f)")


def test_a_dcp_folder_is_read_only_where_a_person_names_it():
    """The DCP reader's callers: its own module's conversion, which only scripts/convert_from_dcp.py calls (with
    the folder given on its command line, whose help says how its .metadata is read), and the checkpoint benchmark,
    on the folder it wrote a moment before into a private temporary folder; no run ever reads one."""
    users = {name: set() for name in ("read_dcp", "full_state", "convert_from_dcp")}
    for path in python_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            used = {getattr(node, "id", None), getattr(node, "attr", None)} | {
                alias.name for alias in getattr(node, "names", []) if isinstance(alias, ast.alias)}
            for name in users.keys() & used:
                users[name].add(str(path.relative_to(ROOT)))
    assert users == {"read_dcp": {"nanoexp/interop/dcp.py", "benchmarks/bench_checkpoint.py"}, "full_state": {"nanoexp/interop/dcp.py"},
                     "convert_from_dcp": {"scripts/convert_from_dcp.py"}}, users
    assert "restricted unpickler" in (ROOT / "scripts" / "convert_from_dcp.py").read_text()


def test_torchs_analyzer_runs_only_over_a_private_folder():
    """Its command names the folder that `tempfile.mkdtemp` made in the same function, never a parameter."""
    tree = ast.parse(FLIGHT_RECORDER.read_text())
    [function] = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  and any(isinstance(c, ast.Constant) and str(c.value).startswith(ANALYZER) for c in ast.walk(f))]
    made = {t.id for a in ast.walk(function) if isinstance(a, ast.Assign) and isinstance(a.value, ast.Call)
            and dotted(a.value.func) == "tempfile.mkdtemp" for t in a.targets}
    [command] = [node for node in ast.walk(function) if isinstance(node, ast.List)
                 and any(isinstance(e, ast.Constant) and str(e.value).startswith(ANALYZER) for e in node.elts)]
    folder = command.elts[[getattr(e, "value", None) for e in command.elts].index(f"{ANALYZER}.fr_trace") + 1]
    assert isinstance(folder, ast.Name) and folder.id in made
    assert folder.id not in {a.arg for a in function.args.args}


class Plant:
    """A pickle that, once loaded, runs a call of the planter's choosing."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.slow
def test_pickles_planted_in_the_run_folder_never_run_at_a_stall(tmp_path):
    """Files named like dumps, in the folders the stall analysis reads and writes, each creating a file when
    unpickled; a stall is diagnosed (by nanoexp and by torch's analyzer) and none of them runs."""
    markers = tmp_path.parent / f"{tmp_path.name}-markers"
    markers.mkdir()
    debug = tmp_path / "debug"
    planted = ["fr/rank_0", "fr/rank_1", "fr/rank_5", "fr/old_rank_3", "fr/sub/rank_1", "fr/sub/deeper/rank_0",
               "fr_json/rank_0.json", "fr_json/rank_5.json", "fr_json/rank_7", "fr_json/sub/rank_1", "rank_0",
               "fr/rank_1.tmp"]
    for number, name in enumerate(planted):
        marker = markers / f"ran_{number}"
        plant = Plant(open, str(marker), "w") if number % 2 else Plant(os.system, f"touch {marker}")
        (debug / name).parent.mkdir(parents=True, exist_ok=True)
        (debug / name).write_bytes(pickle.dumps(plant))
    with pytest.raises(WorkerFailed) as info:
        train(tmp_path, FAST + ["tokens.train_steps=5", "tokens.val_check_interval=0", "debug.stall_s=3",
                                "parallelism=dp2tp1pp1", "fault_injection.skip_collective_rank=1"])
    assert "  - rank 1 has not posted all_reduce" in str(info.value)   # diagnosed from this stall's dumps
    assert "missing ranks: {1}" in (debug / "torchfrtrace.txt").read_text()   # torch's analyzer ran too
    assert not list(markers.iterdir())


@pytest.mark.slow
def test_wandb_is_off_by_default_and_its_key_never_lands_in_the_run(tmp_path):
    secret = "0123456789abcdef-not-a-real-key"
    run_dir = tmp_path / "run"
    before = {p for p in ROOT.rglob("*") if "__pycache__" not in p.parts and ".git" not in p.parts}
    env = dict(os.environ, WANDB_API_KEY=secret)
    proc = subprocess.run(
        [sys.executable, "train.py", "tokens.train_steps=3", "tokens.val_check_interval=0",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "model.model_config.num_hidden_layers=2",
         "tokens.global_batch_size=8", "tokens.limit_val_batches=1", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert written and not (run_dir / "wandb").exists()          # disabled: no W&B files at all
    for path in written:
        assert secret.encode() not in path.read_bytes(), path
    # Nothing new in the repository: the run wrote only into its run folder.
    after = {p for p in ROOT.rglob("*") if "__pycache__" not in p.parts and ".git" not in p.parts}
    assert not {p for p in after - before if ".pytest_cache" not in p.parts}
