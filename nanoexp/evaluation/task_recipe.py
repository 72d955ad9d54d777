"""The recipe of the two held-out Shakespeare tasks for lm-evaluation-harness: the .jsonl files next to their YAMLs
in nanoexp/evaluation/tasks/ (`build_tasks`, run by scripts/build_eval_tasks.py). Only the held-out 5 % of every
work is used, and a line is asked about only if it is a speech line found nowhere in the training text. Docs of a
task are at least 3 lines apart (no context holds another doc's answer); every draw comes from seeded streams and
the files are written with fixed formatting, so building them twice gives byte-identical files. What each task
asks, with examples: nanoexp/evaluation/tasks/README.md."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from nanoexp.data.corpus import load_builtin_documents, load_builtin_titles, split_train_val

HELD_OUT_FRACTION = 0.05
MIN_LINE_CHARS = 10
MIN_GAP = 3  # lines; see the module docstring
STOP_PUNCTUATION = ",.;:!?"
TASKS_DIR = Path(__file__).resolve().parent / "tasks"


@dataclass(frozen=True)
class Work:
    index: int
    title: str
    lines: list[str]  # the held-out tail, one entry per line, trailing whitespace stripped


@dataclass
class Corpus:
    works: list[Work]
    train_text: str
    _unseen: dict[str, bool] = field(default_factory=dict)

    def unseen(self, line: str) -> bool:
        """True when ``line`` occurs nowhere in the training text (memoised: each test scans ~5 MB)."""
        if line not in self._unseen:
            self._unseen[line] = line not in self.train_text
        return self._unseen[line]


def load_corpus() -> Corpus:
    """The held-out lines of every work, and the training text they must not occur in."""
    works, train_parts = [], []
    for index, (title, doc) in enumerate(zip(load_builtin_titles(), load_builtin_documents())):
        train, held_out = split_train_val([doc], HELD_OUT_FRACTION)
        train_parts += train
        lines = [line.rstrip() for line in held_out[0].split("\n")] if held_out else []
        works.append(Work(index, title, lines))
    return Corpus(works, "\n".join(train_parts))


def is_speech_line(line: str) -> bool:
    """A line worth asking about: long enough, not indented, not a speaker name or stage direction."""
    return (
        len(line) >= MIN_LINE_CHARS
        and not line[0].isspace()
        and any(c.islower() for c in line)
        and not line.startswith("[")
    )


def last_word(line: str) -> str | None:
    """The line's last word when it is alphabetic, >= 4 letters and followed by at most one stop mark."""
    word = line.rsplit(" ", 1)[-1] if " " in line else ""
    if word[-1:] and word[-1] in STOP_PUNCTUATION:
        word = word[:-1]
    return word if len(word) >= 4 and word.isascii() and word.isalpha() else None


def pick_spread(rng: random.Random, positions: list[tuple[int, int]], count: int, keep) -> list[tuple[int, int]]:
    """Up to ``count`` positions (work, line), drawn at random, ``keep``-approved, MIN_GAP lines apart."""
    order = positions[:]
    rng.shuffle(order)
    taken: set[tuple[int, int]] = set()
    chosen = []
    for work, i in order:
        if len(chosen) == count:
            break
        if any((work, j) in taken for j in range(i - MIN_GAP + 1, i + MIN_GAP)) or not keep(work, i):
            continue
        taken.add((work, i))
        chosen.append((work, i))
    return sorted(chosen)


def split_line(line: str) -> tuple[str, list[str]] | None:
    """(the line's first half of words, its second half's words) when the second half has at least 3 words that
    can be put in 3 other orders; None otherwise."""
    words = line.split(" ")
    head, rest = words[: len(words) // 2], words[len(words) // 2:]
    if len(rest) < 3 or len(set(rest)) < 3 or not all(words):   # single spaces only
        return None
    return " ".join(head), rest


def reorderings(rng: random.Random, words: list[str], n: int = 3) -> list[str]:
    """``n`` distinct orders of ``words`` other than theirs, each as a continuation (" w1 w2 ...")."""
    true, picked = " " + " ".join(words), []
    while len(picked) < n:
        order = words[:]
        rng.shuffle(order)
        text = " " + " ".join(order)
        if text != true and text not in picked:
            picked.append(text)
    return picked


def choice_docs(corpus: Corpus, seed: int, count: int) -> list[dict]:
    """The shakespeare_choice docs (see the module docstring)."""
    rng = random.Random(f"choice-{seed}")
    positions = [(w.index, i) for w in corpus.works for i in range(1, len(w.lines))
                 if is_speech_line(w.lines[i]) and split_line(w.lines[i]) and w.lines[i - 1].strip()]

    def keep(w: int, i: int) -> bool:
        return corpus.unseen(corpus.works[w].lines[i])

    docs = []
    for w, i in pick_spread(rng, positions, count, keep):
        work = corpus.works[w]
        head, rest = split_line(work.lines[i])
        true = " " + " ".join(rest)
        choices = [true] + reorderings(rng, rest)
        rng.shuffle(choices)
        docs.append({
            "id": f"choice-{w:02d}-{i:04d}",
            "work": work.title,
            "context": work.lines[i - 1] + "\n" + head,
            "choices": choices,
            "label": choices.index(true),
        })
    return docs


def complete_docs(corpus: Corpus, seed: int, count: int) -> list[dict]:
    """The shakespeare_complete docs (see the module docstring)."""
    rng = random.Random(f"complete-{seed}")
    positions = [
        (w.index, i) for w in corpus.works for i in range(1, len(w.lines))
        if is_speech_line(w.lines[i]) and last_word(w.lines[i]) and w.lines[i - 1].strip()
    ]

    def asked(w: int, i: int) -> tuple[str, str]:
        """(the line up to the middle of its last word, the rest of that word)."""
        line = corpus.works[w].lines[i]
        word = last_word(line)
        half = len(word) // 2
        return line[: line.rindex(" ") + 1] + word[:half], word[half:]

    def keep(w: int, i: int) -> bool:
        # Unseen up to the end of the answer: "Take her away." is not in the training text, "Take her away;" is.
        return corpus.unseen("".join(asked(w, i)))

    docs = []
    for w, i in pick_spread(rng, positions, count, keep):
        head, rest = asked(w, i)
        docs.append({
            "id": f"complete-{w:02d}-{i:04d}",
            "work": corpus.works[w].title,
            "context": corpus.works[w].lines[i - 1] + "\n" + head,
            "target": rest,
        })
    return docs


def write_jsonl(path: Path, docs: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")


def build_tasks(out_dir: Path = TASKS_DIR, seed: int = 1234, count: int = 500) -> list[tuple[Path, int]]:
    """Write shakespeare_choice.jsonl and shakespeare_complete.jsonl (up to `count` docs each) into `out_dir`;
    return each file with its number of docs."""
    corpus = load_corpus()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in (("shakespeare_choice", choice_docs), ("shakespeare_complete", complete_docs)):
        docs = build(corpus, seed, count)
        random.Random(seed).shuffle(docs)   # so that the first n docs (eval.limit=n) span the works
        write_jsonl(out_dir / f"{name}.jsonl", docs)
        written.append((out_dir / f"{name}.jsonl", len(docs)))
    return written
