"""`kvflow generate` (one prompt) and `kvflow chat` (multi-turn, in the terminal)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvflow.entrypoints.cli_args import (add_model_args, add_runtime_args, add_sampling_args, engine_config_from_args,
                                         format_stats, sampling_params_from_args, with_cli_defaults)


def _build_llm(args: argparse.Namespace):
    from kvflow.entrypoints.llm import LLM

    return LLM(**dataclasses.asdict(engine_config_from_args(args)))


def register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user message first")
    add_model_args(p)
    add_runtime_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)  # fail on bad options before loading weights
    llm = _build_llm(args)
    params = with_cli_defaults(params, args, llm)
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat_template else args.prompt
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    if args.verbose:  # on stderr, so that stdout stays the text alone
        print(f"{params}\n{format_stats(out)}", file=sys.stderr)
    return 0


def register_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat in the terminal (/reset, /exit)")
    p.add_argument("--system", default=None, help="system prompt")
    add_model_args(p)
    add_runtime_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=run_chat)


_EXIT, _RESET = ("/exit", "/quit", "/bye"), ("/reset", "/clear")
_CHAT_HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def run_chat(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    """Reads a line, streams the reply, keeps the history (through the chat template) until /reset."""
    from kvflow.entrypoints.openai.streaming import TextStreamer

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    params = sampling_params_from_args(args)
    llm = _build_llm(args)
    params = with_cli_defaults(params, args, llm)
    engine = llm.engine
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    stdout.write(f"{params}. {_CHAT_HELP}.\n")
    turn = 0
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            stdout.write("\n")
            break
        text = line.strip()
        if text in _EXIT:
            break
        if text in _RESET:
            history = list(system)
            stdout.write("(new conversation)\n")
            continue
        if text in ("/help", "/?"):
            stdout.write(_CHAT_HELP + "\n")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        request_id, streamer, reply, final = f"chat-{turn}", TextStreamer(params.stop), "", None
        turn += 1
        try:
            engine.add_request(request_id, llm.apply_chat_template(history), params)
        except ValueError as exc:  # the conversation outgrew max_model_len: say so, keep the session
            history.pop()
            stdout.write(f"error: {exc}\n(/reset starts a new conversation)\n")
            continue
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reply, final = out.outputs[0].text, out
                    stdout.write(streamer.delta(reply, out.finished))
                    stdout.flush()
        except KeyboardInterrupt:
            engine.abort_request(request_id)
            reply = reply[:streamer.sent]
        stdout.write("\n")
        if args.verbose and final is not None:
            stdout.write(format_stats(final) + "\n")
        history.append({"role": "assistant", "content": reply})
    return 0
