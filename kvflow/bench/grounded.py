"""W-grounded: chat prompts whose answers quote their own prompt, for speculative decoding.

N-gram prompt lookup pays off when the output copies spans of the prompt: code edits,
extraction, restating a given passage. Random token ids (W-offline) never do, so they
cannot show it. This workload builds such prompts from text that ships inside the kvflow
package itself, so nothing is downloaded and every checkout can rebuild it:

* code passages: classes, functions and methods of kvflow's own Python modules, cut with
  `ast` (a class whole when it fits, else its methods), dedented;
* prose passages: each module's docstrings in source order, packed by paragraph.

Every passage is 150 to 600 tokens. Requests cycle through three kinds, and each kind
alternates between its two instructions:

* ``edit``: rewrite the code with a real local variable renamed, or without its comments
  and docstrings (output only the code);
* ``extract``: copy every line containing a given identifier, or list the functions
  defined with their arguments;
* ``summarize``: summarize a passage quoting its key sentence, or repeat it correcting
  its spelling.

The kinds differ on purpose in how much they copy (renaming copies nearly everything,
summarizing little), so the mix does not flatter one method; report results per kind
(`scripts/grounded_overlap.py` measures how much the default model's outputs quote).

Determinism: the draw is a pure function of `seed`, the tokenizer and the shipped source
of SOURCES. It changes whenever one of those files changes; record `workload_fingerprint`
with any result. SOURCES leaves out bench and what speculative decoding mostly changes
(engine, sampling, spec_decode, config.py, the CLI and offline entry points), so that most
work there leaves the workload alone; any edit inside SOURCES moves it.
Passages are drawn without replacement; `exclude` keeps another draw's passages out (a
warm-up set must not share passages with the timed set, or the prefix cache serves them).
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.bench.datasets import BenchRequest

KINDS = ("edit", "extract", "summarize")
SOURCES = ("entrypoints/openai", "layers", "loader", "models")
PASSAGE_TOKENS = (150, 600)
PROSE_CHUNK_TOKENS = 200  # a prose chunk closes once it has this many tokens (or the next paragraph overflows)
NEW_NAMES = ("value", "item", "result", "entry", "total", "state", "current", "handle", "record", "amount")

EDIT_RENAME = "Rewrite this Python code with the variable `{old}` renamed to `{new}`. Output only the code."
EDIT_STRIP = "Rewrite this Python code without its comments and docstrings. Output only the code."
EXTRACT_LINES = "Copy every line of this code that contains `{word}`, exactly as written, one per line."
# "List the names of the functions defined in this code, ..." got SmolLM2-135M to name 12% of
# the functions (it described or copied the code); this question form names 46% (8 passages).
EXTRACT_DEFS = "Which functions does this code define? Answer with their names and arguments, one per line."
SUMMARIZE = "Summarize this documentation in your own words, then quote its key sentence exactly."
SPELLING = "Repeat the following text, correcting its spelling."


@dataclass
class GroundedRequest(BenchRequest):
    kind: str  # one of KINDS
    source: str  # "kvflow/<path>:<first>-<last line>" (code) or "kvflow/<path>:docstrings:<lines>" (prose)
    instruction: str
    passage: str


@dataclass(frozen=True)
class Passage:
    source: str
    text: str
    is_code: bool


def package_root() -> Path:
    return Path(__file__).resolve().parent.parent


def _source_files(root: Path) -> list[Path]:
    files = []
    for name in SOURCES:
        path = root / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _in_range(tokenizer, text: str) -> bool:
    return PASSAGE_TOKENS[0] <= _count(tokenizer, text) <= PASSAGE_TOKENS[1]


def _code_passages(tokenizer, rel: str, source: str) -> list[Passage]:
    """Top-level classes that fit whole, else their methods; top-level functions that fit."""
    lines = source.splitlines()

    def cut(node) -> Passage:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        text = textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))
        return Passage(f"{rel}:{first}-{node.end_lineno}", text, True)

    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        passage = cut(node)
        if _in_range(tokenizer, passage.text):
            out.append(passage)
        elif isinstance(node, ast.ClassDef):
            methods = [cut(m) for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            out += [m for m in methods if _in_range(tokenizer, m.text)]
    return out


def _prose_passages(tokenizer, rel: str, source: str) -> list[Passage]:
    """The module's docstrings in source order, as paragraphs packed into chunks of 150 to 600 tokens."""
    paragraphs: list[tuple[int, str]] = []  # (line, paragraph)

    def visit(node) -> None:
        doc = ast.get_docstring(node)
        if doc:
            line = getattr(node, "lineno", 1)
            paragraphs.extend((line, p.strip()) for p in re.split(r"\n\s*\n", doc) if p.strip())
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)

    visit(ast.parse(source))
    out, chunk = [], []

    def flush() -> None:
        text = "\n\n".join(p for _, p in chunk)
        if chunk and _in_range(tokenizer, text):
            out.append(Passage(f"{rel}:docstrings:{chunk[0][0]}-{chunk[-1][0]}", text, False))

    for line, para in paragraphs:
        current = _count(tokenizer, "\n\n".join(p for _, p in chunk))
        if chunk and (current >= PROSE_CHUNK_TOKENS
                      or _count(tokenizer, "\n\n".join([p for _, p in chunk] + [para])) > PASSAGE_TOKENS[1]):
            flush()
            chunk = []
        chunk.append((line, para))
    flush()
    return out


def passage_pools(tokenizer, root: Path | None = None) -> tuple[list[Passage], list[Passage]]:
    """(code, prose) passages of SOURCES, in file and line order."""
    root = root or package_root()
    code, prose = [], []
    for path in _source_files(root):
        rel = f"kvflow/{path.relative_to(root).as_posix()}"
        source = path.read_text(encoding="utf-8")
        code += _code_passages(tokenizer, rel, source)
        prose += _prose_passages(tokenizer, rel, source)
    return code, prose


def _identifiers(text: str) -> tuple[dict[str, int], set[str]]:
    """(occurrences of each local variable or parameter, every name and attribute in the code)."""
    tree = ast.parse(text)
    counts: dict[str, int] = {}
    stored: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg not in ("self", "cls"):
            stored.add(node.arg)
            counts[node.arg] = counts.get(node.arg, 0) + 1
        elif isinstance(node, ast.Name):
            names.add(node.id)
            counts[node.id] = counts.get(node.id, 0) + 1
            if isinstance(node.ctx, ast.Store):
                stored.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return {k: counts[k] for k in stored if counts[k] >= 2}, names | set(counts)


def _has_comment_or_docstring(text: str) -> bool:
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    if any(isinstance(n, defs) and ast.get_docstring(n) for n in ast.walk(ast.parse(text))):
        return True
    return any(t.type == tokenize.COMMENT for t in tokenize.generate_tokens(io.StringIO(text).readline))


# One function per instruction template: the instruction for this passage, or None (before
# drawing anything from rng) when the template does not apply to it.
def _rename(p: Passage, rng: np.random.Generator) -> str | None:
    renamable, _ = _identifiers(p.text)
    words = set(re.findall(r"\w+", p.text))
    free = [n for n in NEW_NAMES if n not in words]
    if not renamable or not free:
        return None
    old = sorted(renamable)[rng.integers(len(renamable))]
    return EDIT_RENAME.format(old=old, new=free[rng.integers(len(free))])


def _strip(p: Passage, rng: np.random.Generator) -> str | None:
    return EDIT_STRIP if _has_comment_or_docstring(p.text) else None


def _copy_lines(p: Passage, rng: np.random.Generator) -> str | None:
    """An identifier on at least 2 and at most a third of the passage's lines."""
    _, names = _identifiers(p.text)
    lines = [ln for ln in p.text.splitlines() if ln.strip()]
    limit = max(2, len(lines) // 3)
    words = sorted(w for w in names if 2 <= sum(bool(re.search(rf"\b{re.escape(w)}\b", ln)) for ln in lines) <= limit)
    return EXTRACT_LINES.format(word=words[rng.integers(len(words))]) if words else None


def _list_defs(p: Passage, rng: np.random.Generator) -> str | None:
    defs = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(ast.parse(p.text)))
    return EXTRACT_DEFS if defs >= 2 else None


# Each kind's k-th request uses template k % 2, so both templates of a kind come evenly.
TEMPLATES = {
    "edit": (_rename, _strip),
    "extract": (_copy_lines, _list_defs),
    "summarize": (lambda p, rng: SUMMARIZE, lambda p, rng: SPELLING),
}


def _user_message(instruction: str, p: Passage) -> str:
    body = f"```python\n{p.text}\n```" if p.is_code else p.text
    return f"{instruction}\n\n{body}"


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    """One user turn through the tokenizer's chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def grounded_requests(tokenizer, num_prompts: int = 16, seed: int = 0, output_len: int = 128,
                      exclude: list[BenchRequest] | tuple = ()) -> list[GroundedRequest]:
    """`num_prompts` requests cycling edit, extract, summarize, each kind alternating its two
    instructions (TEMPLATES); passages drawn without replacement in an order from `default_rng(seed)`.

    The first n requests do not depend on `num_prompts` >= n. Passages used by the GroundedRequests in `exclude` are never drawn.
    """
    rng = np.random.default_rng(seed)
    code, prose = passage_pools(tokenizer)
    skip = {r.source for r in exclude if isinstance(r, GroundedRequest)}
    pools = {False: [code[i] for i in rng.permutation(len(code))], True: [prose[i] for i in rng.permutation(len(prose))]}
    pools = {k: [p for p in v if p.source not in skip] for k, v in pools.items()}
    requests: list[GroundedRequest] = []
    for i in range(num_prompts):
        kind = KINDS[i % len(KINDS)]
        template = TEMPLATES[kind][(i // len(KINDS)) % 2]
        pool = pools[kind == "summarize"]
        for j, passage in enumerate(pool):  # the first passage left that this template applies to
            instruction = template(passage, rng)
            if instruction is not None:
                del pool[j]
                break
        else:
            raise ValueError(f"grounded workload: not enough {'prose' if kind == 'summarize' else 'code'} passages "
                             f"for {num_prompts} prompts (SOURCES has too few; lower --num-prompts)")
        ids = chat_prompt_ids(tokenizer, _user_message(instruction, passage))
        requests.append(GroundedRequest(ids, output_len, kind, passage.source, instruction, passage.text))
    return requests


def workload_fingerprint(requests: list[BenchRequest]) -> str:
    """sha256 of every prompt's token ids and output length, in order: record it with any result."""
    h = hashlib.sha256()
    for r in requests:
        h.update(np.asarray(r.prompt_token_ids, dtype="<i8").tobytes())
        h.update(np.asarray([-1, r.output_len], dtype="<i8").tobytes())
    return h.hexdigest()


def prompt_lookup_hits(prompt: list[int], output: list[int], min_n: int = 2, max_n: int = 4) -> list[bool]:
    """For each output token: would n-gram prompt lookup have predicted it?

    Before each token, take the longest suffix of the context (prompt + output so far), of
    max_n down to min_n tokens, that occurred earlier in the context; the prediction is the
    token after its latest earlier occurrence. No earlier occurrence: no prediction (False).
    """
    seq = list(prompt)
    last: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its latest occurrence (known token)

    def record(end: int) -> None:  # the n-grams ending just before seq[end], whose next token is seq[end]
        for n in range(min_n, max_n + 1):
            if end - n >= 0:
                last[tuple(seq[end - n : end])] = end

    for end in range(len(seq)):
        record(end)
    hits = []
    for token in output:
        guess = None
        for n in range(max_n, min_n - 1, -1):
            if len(seq) >= n and (at := last.get(tuple(seq[len(seq) - n :]))) is not None:
                guess = seq[at]
                break
        hits.append(guess == token)
        seq.append(token)
        record(len(seq) - 1)
    return hits
