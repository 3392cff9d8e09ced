"""The grammar engine behind structured output: xgrammar, on the CPU.

Only this module imports xgrammar. It turns a `StructuredOutputsParams` into xgrammar's
compiled grammar (token-level automaton over the engine's vocabulary) and makes per-sequence
matchers from one. xgrammar's own compile cache is off: `manager.py` keeps the one cache, so
its hit counts are the truth and its size bound is the only one.
"""

from __future__ import annotations

import re
from typing import Any

from kvflow.structured_output.json_schema import describe_unenforced
from kvflow.structured_output.params import StructuredOutputsParams


# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: ", which means nothing to a client.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot compile (bad schema, regex or grammar), or cannot serve here.

    `field` names the constraint's field (`json`, `regex`, `choice`, `grammar`, `json_object`), so
    the server can point at what the client sent.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices`: one quoted alternative per string."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class XGrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe (xgrammar's compiler is).

    `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's: ids past
    the tokenizer are never allowed. `stop_token_ids` are the engine's EOS ids, the tokens a
    matcher accepts once the grammar is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """xgrammar's CompiledGrammar for `params`; StructuredOutputError if it does not compile."""
        kind = params.kind
        compact = params.disable_any_whitespace
        if kind == "json" and (refusal := describe_unenforced(params.schema())) is not None:
            raise StructuredOutputError(f"structured_outputs.json: {refusal}", field=kind)
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(params.schema_text(), any_whitespace=not compact)
            if kind == "json_object":  # any object: strict mode would forbid every property of {"type": "object"}
                return self.compiler.compile_json_schema('{"type":"object"}', any_whitespace=not compact,
                                                         strict_mode=False)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice or []))
            return self.compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice list", "grammar": "EBNF grammar"}[kind]
            lines = str(exc).strip().splitlines()
            detail = _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
            raise StructuredOutputError(f"structured_outputs.{kind}: invalid {what}: {detail}", field=kind) from None

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the grammar's start; it ends (is_terminated) after a stop token."""
        return self._xgr.GrammarMatcher(compiled)
