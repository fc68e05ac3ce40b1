"""The training corpus present on every machine: the interpreter's own Python sources.

The standard library of the running interpreter (and, for larger models, the installed packages'
sources) is read in a deterministic order: sorted relative paths. A fixed share of the files is held
out by a hash of the relative path, so evaluation prompts never come from training text; the rule
depends only on the path, so a file held out under Python 3.11 is held out under 3.12 too.

Evaluation prompts come from held-out files: code-completion prompts (a function's signature and
docstring, found with `ast`) and instruction-style chat prompts built from the same docstrings.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

# One file in HELD_OUT_MOD is held out (its hash of the relative path is 0 mod this).
HELD_OUT_MOD = 16
# Files larger than this are generated tables (e.g. pydoc_data/topics.py), not code to learn from.
MAX_FILE_BYTES = 200_000
_SKIP_DIRS = {
    "test",
    "tests",
    "testing",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "_vendor",
    "vendored",
}

_CHAT_TEMPLATES = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement `{sig}` in Python. {doc}",
    "Can you write a Python function named `{name}`? {doc}",
    "Write a Python function `{sig}`.\nDocstring: {doc}",
)


@dataclass(frozen=True)
class SourceFile:
    # "stdlib/json/decoder.py" or "site/numpy/core/fromnumeric.py"
    path: str
    text: str


@dataclass(frozen=True)
class FunctionInfo:
    path: str
    name: str
    lineno: int
    # Dedented `def ...:` line(s) through the closing quotes of the docstring.
    header: str
    # Dedented whole function (header + body).
    source: str
    signature: str
    docstring: str
    body_lines: int


def stable_hash(s: str) -> int:
    """A hash that is the same in every process and Python version (unlike `hash`)."""
    return int.from_bytes(hashlib.md5(s.encode()).digest()[:8], "little")


def is_held_out(path: str) -> bool:
    return stable_hash(path) % HELD_OUT_MOD == 0


def corpus_roots(packages: bool) -> list[tuple[str, str]]:
    """(label, directory) pairs: the stdlib, then the installed packages' directories."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", paths["stdlib"])]
    if packages:
        seen = set()
        for key in ("purelib", "platlib"):
            d = paths.get(key)
            if d and os.path.isdir(d) and os.path.realpath(d) not in seen:
                seen.add(os.path.realpath(d))
                roots.append(("site", d))
    return roots


def _walk_py(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted in place so os.walk descends in a fixed order; skip tests and metadata.
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", "-info"))
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _copies(sub: str, held_stdlib: set[str]) -> bool:
    """Whether a package file's path ends with a held-out stdlib module's path."""
    parts = sub.split("/")
    return any("/".join(parts[i:]) in held_stdlib for i in range(len(parts) - 1))


def _read(path: str, max_file_bytes: int) -> str | None:
    try:
        if os.path.getsize(path) > max_file_bytes:
            return None
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def load_corpus(
    split: str = "train",
    packages: bool = False,
    max_bytes: int | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    limit: int | None = None,
) -> list[SourceFile]:
    """The corpus files of one split ("train", "heldout" or "all"), sorted by relative path.

    `max_bytes` caps the total (counted in characters): the stdlib always comes whole, and
    package files are taken in the order of their path hash (an unbiased sample across packages)
    until the cap is reached.
    `limit` keeps the first `limit` files (tests use a tiny corpus)."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be train, heldout or all; got {split!r}")
    files: list[SourceFile] = []
    used = 0
    # Package copies of held-out stdlib modules (setuptools/_distutils/util.py ...) stay out of
    # training too.
    held_stdlib: set[str] = set()
    for label, root in corpus_roots(packages):
        found = []
        for path in _walk_py(root):
            sub = os.path.relpath(path, root).replace(os.sep, "/")
            rel = f"{label}/{sub}"
            held = is_held_out(rel)
            if label == "stdlib" and held:
                held_stdlib.add(sub)
            if label == "site" and not held and _copies(sub, held_stdlib):
                continue
            if split != "all" and held != (split == "heldout"):
                continue
            found.append((rel, path))
        if label == "site" and max_bytes is not None:
            found.sort(key=lambda rp: stable_hash(rp[0]))
        for rel, path in found:
            if limit is not None and len(files) >= limit:
                break
            if max_bytes is not None and label == "site" and used >= max_bytes:
                break
            text = _read(path, max_file_bytes)
            if text is not None:
                files.append(SourceFile(rel, text))
                used += len(text)
    return sorted(files, key=lambda f: f.path)


def corpus_bytes(files: list[SourceFile]) -> int:
    return sum(len(f.text.encode()) for f in files)


# ---- functions, prompts -----------------------------------------------------------------------
def extract_functions(f: SourceFile) -> list[FunctionInfo]:
    """Every function in the file that has a docstring, with its dedented header and source."""
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError):
        return []
    lines = f.text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        first = node.body[0]
        if doc is None or len(node.body) < 2 or first.end_lineno is None:
            continue
        header = textwrap.dedent("\n".join(lines[node.lineno - 1 : first.end_lineno]))
        source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        if not header.startswith(("def ", "async def ")):
            continue  # a one-line `def f(): """doc"""; ...` or odd layout
        sig_end = header.find(":\n")
        signature = " ".join(header[: sig_end if sig_end > 0 else len(header)].split())
        signature = signature.removeprefix("async ").removeprefix("def ")
        body_lines = (node.end_lineno or first.end_lineno) - first.end_lineno
        out.append(
            FunctionInfo(f.path, node.name, node.lineno, header, source, signature, doc, body_lines)
        )
    out.sort(key=lambda fn: fn.lineno)
    return out


def _simple(fn: FunctionInfo) -> bool:
    """Short, self-contained functions: good completion prompts a small model can finish."""
    return (
        12 <= len(fn.docstring) <= 500
        and fn.header.count("\n") <= 14
        and 1 <= fn.body_lines <= 30
        and len(fn.signature) <= 100
        and "\t" not in fn.source
        and _header_parses(fn.header)
    )


def _header_parses(header: str) -> bool:
    try:
        ast.parse(header + "\n    pass\n")
    except SyntaxError:
        return False
    return True


def _first_sentence(doc: str) -> str:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    end = para.find(". ")
    return para if end < 0 else para[: end + 1]


def chat_messages(fn: FunctionInfo, with_answer: bool) -> list[dict[str, str]]:
    """An instruction-style conversation about one function (the answer is its source)."""
    template = _CHAT_TEMPLATES[stable_hash(fn.path + fn.name) % len(_CHAT_TEMPLATES)]
    user = template.format(sig=fn.signature, name=fn.name, doc=_first_sentence(fn.docstring))
    msgs = [{"role": "user", "content": user}]
    if with_answer:
        msgs.append({"role": "assistant", "content": f"```python\n{fn.source}\n```"})
    return msgs


def chat_examples(files: list[SourceFile], max_examples: int | None = None) -> list[list[dict]]:
    """Training conversations from the functions of (training) files, in file order."""
    out = []
    for f in files:
        for fn in extract_functions(f):
            if 20 <= len(fn.docstring) and fn.body_lines <= 60 and len(fn.source) <= 4000:
                out.append(chat_messages(fn, with_answer=True))
                if max_examples is not None and len(out) >= max_examples:
                    return out
    return out


def _pick(cands: list[FunctionInfo], n: int, per_file: int, salt: str) -> list[FunctionInfo]:
    """n candidates in hash order, at most `per_file` from one file (so prompts are varied)."""
    chosen: list[FunctionInfo] = []
    count: dict[str, int] = {}
    for fn in sorted(cands, key=lambda c: stable_hash(f"{salt}:{c.path}:{c.lineno}")):
        if count.get(fn.path, 0) < per_file:
            chosen.append(fn)
            count[fn.path] = count.get(fn.path, 0) + 1
            if len(chosen) == n:
                break
    return chosen


def code_prompts(files: list[SourceFile], n: int = 150, per_file: int = 8) -> list[dict]:
    """Code-completion prompts: a function's signature and docstring, ending at the closing quotes
    (the model's first token is then the newline + indent that opens the body)."""
    cands = [fn for f in files for fn in extract_functions(f) if _simple(fn)]
    chosen = _pick(cands, n, per_file, "code")
    # The first prompt is the default demo prompt: the shortest plain function (no `self`)
    # among the first thirty.
    if chosen:
        best = min(
            range(min(30, len(chosen))),
            key=lambda i: ("(self" in chosen[i].signature, len(chosen[i].header)),
        )
        chosen.insert(0, chosen.pop(best))
    return [
        {"prompt": fn.header, "source": fn.path, "name": fn.name, "lineno": fn.lineno}
        for fn in chosen
    ]


def chat_prompts(files: list[SourceFile], n: int = 120, per_file: int = 6) -> list[dict]:
    """Instruction-style prompts (`prompt` is the user message) from held-out docstrings."""
    cands = [fn for f in files for fn in extract_functions(f) if _simple(fn)]
    chosen = _pick(cands, n, per_file, "chat")
    return [
        {"prompt": chat_messages(fn, with_answer=False)[0]["content"], "source": fn.path}
        for fn in chosen
    ]


def write_prompt_files(out_dir: str, n_code: int = 150, n_chat: int = 120) -> dict[str, int]:
    """Write code_prompts.jsonl and chat_prompts.jsonl from the stdlib's held-out files.

    These files ship with the package (specserve/data/): they are written once and committed, so
    every machine evaluates on the same prompts whatever its Python version."""
    held = load_corpus("heldout", packages=False)
    counts = {}
    for name, rows in (
        ("code_prompts.jsonl", code_prompts(held, n_code)),
        ("chat_prompts.jsonl", chat_prompts(held, n_chat)),
    ):
        with open(os.path.join(out_dir, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        counts[name] = len(rows)
    return counts


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":  # python -m specserve.train.corpus [OUT_DIR]: rewrite the prompt files
    import sys

    default = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
    print(write_prompt_files(sys.argv[1] if len(sys.argv) > 1 else default))
