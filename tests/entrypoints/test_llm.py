"""The offline API: vLLM-shaped results, clear errors for bad input, aborts that free blocks."""

from __future__ import annotations

import pytest

from kvflow import LLM, Logprob, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _pool_is_whole(llm: LLM) -> None:
    llm.engine.check_integrity()
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_generate_returns_vllm_shaped_outputs_in_order(smollm2_fp32):
    prompts = ["Hello, my name is", {"prompt_token_ids": [504, 3575, 282]}, "The sky is"]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), GREEDY]
    outs = smollm2_fp32.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello, my name is", None, "The sky is"]
    assert outs[1].prompt_token_ids == [504, 3575, 282]
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 3, 12]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    assert outs[0].outputs[0].text == smollm2_fp32.get_tokenizer().decode(outs[0].outputs[0].token_ids)
    assert smollm2_fp32.llm_engine is smollm2_fp32.engine  # vLLM's attribute name
    m = outs[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time  # the last token's time,
    assert m.last_token_time > m.first_token_time  # not the record's (made after finished_time)
    _pool_is_whole(smollm2_fp32)


def test_logprobs_are_vllm_logprob_records(smollm2_fp32):
    """Code ported from vLLM reads `out.logprobs[i][token].logprob`, `.rank` and `.decoded_token`;
    the sampled token comes first, its rank measured; the top k are ranked in order."""
    tok = smollm2_fp32.get_tokenizer()
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = smollm2_fp32.generate("The capital of France is", params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tid, entry in zip(comp.token_ids, comp.logprobs):
        assert isinstance(entry[tid], Logprob) and next(iter(entry)) == tid
        others = sorted((t for t in entry if t != tid), key=lambda t: -entry[t].logprob)
        ranks = [entry[t].rank for t in others]
        assert ranks == sorted(set(ranks)) and set(ranks) <= {1, 2, 3}
        above = sum(entry[t].logprob > entry[tid].logprob for t in others)
        assert entry[tid].rank == above + 1 if above < 3 else entry[tid].rank > 3
        for t, lp in entry.items():
            assert lp.decoded_token == tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))
    assert out.prompt_logprobs[0] is None
    for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert entry[t].rank >= 1 and entry[t].decoded_token == tok.decode([t])
    bare = smollm2_fp32.generate("The capital of France is", SamplingParams(
        temperature=0.8, seed=7, max_tokens=6, logprobs=3, prompt_logprobs=2, detokenize=False), use_tqdm=False)[0]
    assert [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in bare.outputs[0].logprobs] == [
        {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in comp.logprobs]
    entries = bare.outputs[0].logprobs + bare.prompt_logprobs[1:]
    assert all(lp.decoded_token is None for e in entries for lp in e.values())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda llm: llm.generate("", GREEDY, use_tqdm=False), "prompt"),
        (lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False), "prompt"),
        (lambda llm: llm.generate({"prompt_token_ids": [5] * 3000}, GREEDY, use_tqdm=False), "max_model_len"),
        (lambda llm: llm.generate({"prompt_token_ids": [10**7]}, GREEDY, use_tqdm=False), "prompt"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=-1), use_tqdm=False), "max_tokens"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5), use_tqdm=False), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0), use_tqdm=False), "top_p"),
        (lambda llm: llm.generate(["a", "b"], [GREEDY], use_tqdm=False), "sampling_params"),
        (lambda llm: llm.chat([], GREEDY, use_tqdm=False), "messages"),
        (lambda llm: llm.generate(5, GREEDY, use_tqdm=False), "^prompts: expected a string.*got int"),
        (lambda llm: llm.generate(b"hello", GREEDY, use_tqdm=False), "^prompts: .*got bytes"),
        (lambda llm: llm.generate({"prompt_token_ids": [1.0, 2.0]}, GREEDY, use_tqdm=False),
         "^prompt: token ids must be integers, got 1.0"),
        (lambda llm: llm.generate({"prompt_token_ids": [True, 2]}, GREEDY, use_tqdm=False),
         "^prompt: token ids must be integers, got True"),
        (lambda llm: llm.generate({"prompt_token_ids": "abc"}, GREEDY, use_tqdm=False),
         "^prompt: prompt_token_ids must be a list of integers, got str"),
        (lambda llm: llm.generate("abc\ud800", GREEDY, use_tqdm=False), "^prompt: the text is not valid Unicode"),
        (lambda llm: llm.generate("hi", GREEDY, use_tqdm=False, priority=[2**70]),
         "^priority must be a 64-bit integer"),
        (lambda llm: llm.generate("hi", SamplingParams(top_k=2**64), use_tqdm=False), "^top_k must be in"),
        (lambda llm: llm.generate("hi", GREEDY, use_tqdm=False, lora_request="sql"),
         "^lora_request: expected a LoRARequest or a list of them, got str"),
        (lambda llm: llm.generate("hi", {"max_tokens": 2}, use_tqdm=False),
         "^sampling_params: expected a SamplingParams or a list of them, got dict"),
    ],
)
def test_bad_input_names_the_parameter_and_engine_keeps_serving(smollm2_fp32, make, match):
    with pytest.raises(ValueError, match=match):
        make(smollm2_fp32)
    _pool_is_whole(smollm2_fp32)
    out = smollm2_fp32.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12


def test_bad_batch_leaves_nothing_behind(smollm2_fp32):
    with pytest.raises(ValueError, match="prompt"):
        smollm2_fp32.generate(["fine", "", "also fine"], GREEDY, use_tqdm=False)
    assert not smollm2_fp32.engine.has_unfinished_requests()
    _pool_is_whole(smollm2_fp32)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="model.*does not exist"):
        LLM("/nonexistent/model/dir")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(ValueError, match="corrupt"):
        LLM(str(bad))


def test_abort_frees_blocks_and_leaves_others_unchanged(smollm2_fp32):
    engine = smollm2_fp32.engine
    alone = smollm2_fp32.generate(["Tell me about cats.", "Tell me about dogs."], GREEDY, use_tqdm=False)
    engine.add_request("keep-1", "Tell me about cats.", GREEDY)
    engine.add_request("victim", "A long story: " * 20, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.add_request("keep-2", "Tell me about dogs.", GREEDY)
    for _ in range(3):
        engine.step()
    used_before = engine.kv_cache_manager.num_blocks - engine.kv_cache_manager.num_free_blocks
    assert engine.abort_request("victim")
    used_after = engine.kv_cache_manager.num_blocks - engine.kv_cache_manager.num_free_blocks
    assert used_after < used_before
    assert not engine.abort_request("victim")  # already gone
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "victim"
            if out.finished:
                finals[out.request_id] = out
    assert finals["keep-1"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert finals["keep-2"].outputs[0].token_ids == alone[1].outputs[0].token_ids
    _pool_is_whole(smollm2_fp32)


def test_stop_strings_and_stop_tokens(smollm2_fp32):
    base = smollm2_fp32.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    words = base.text.split()
    stop = words[2]
    out = smollm2_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                                use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and base.text.startswith(out.text)
    tok = base.token_ids[3]
    first = base.token_ids.index(tok)  # generation stops at the token's first occurrence
    out = smollm2_fp32.generate("The capital of France is",
                                SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == base.token_ids[: first + 1] and out.outputs[0].stop_reason == tok


def test_the_stopping_token_is_not_text_unless_asked(smollm2_fp32):
    """vLLM's rule: the EOS or stop token that ends a sequence adds no text, even with special
    tokens kept, unless include_stop_str_in_output (a parser reading special tokens relies on it)."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    kept = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    out = smollm2_fp32.chat(chat, kept, use_tqdm=False)[0].outputs[0]
    eos = smollm2_fp32.get_tokenizer().decode([out.token_ids[-1]])
    assert out.finish_reason == "stop" and eos == "<|im_end|>"
    assert out.text and not out.text.endswith(eos)
    asked = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False, include_stop_str_in_output=True)
    assert smollm2_fp32.chat(chat, asked, use_tqdm=False)[0].outputs[0].text == out.text + eos
    tok = out.token_ids[2]
    stopped = smollm2_fp32.chat(chat, SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[tok]),
                                use_tqdm=False)[0].outputs[0]
    first = out.token_ids.index(tok)
    assert stopped.text == smollm2_fp32.get_tokenizer().decode(out.token_ids[:first])


def test_seeded_sampling_is_reproducible_across_batches(smollm2_fp32):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = smollm2_fp32.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    batch = smollm2_fp32.generate(["Hello", "Once upon a time", "Why"],
                                  [SamplingParams(temperature=1.0, max_tokens=10), params,
                                   SamplingParams(temperature=0.7, max_tokens=5, seed=9)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_progress_bar(smollm2_fp32, capsys):
    smollm2_fp32.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    smollm2_fp32.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_chat_template_options_as_vllm_takes_them(smollm2_fp32):
    conversation = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    cont = smollm2_fp32.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert cont["prompt"].endswith("The color is")  # no end-of-turn after it: the reply goes on from there
    out = smollm2_fp32.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                            continue_final_message=True)[0]
    assert out.prompt == cont["prompt"] and out.prompt_token_ids == cont["prompt_token_ids"]
    with pytest.raises(ValueError, match="^continue_final_message"):
        smollm2_fp32.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)

    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% for t in tools or [] %}tool={{ t.function.name }}\n{% endfor %}{{ suffix }}")
    rendered = smollm2_fp32.apply_chat_template(
        conversation[:1], chat_template=template, tools=[{"type": "function", "function": {"name": "paint"}}],
        chat_template_kwargs={"suffix": "[assistant]"})
    assert rendered["prompt"] == "[user] Name a color.\ntool=paint\n[assistant]"
    # As in vLLM, chat_template_kwargs may carry the template's own options too.
    via_kwargs = smollm2_fp32.apply_chat_template(conversation[:1], chat_template=template, chat_template_kwargs={
        "suffix": "[assistant]", "tools": [{"type": "function", "function": {"name": "paint"}}]})
    assert via_kwargs == rendered
    _pool_is_whole(smollm2_fp32)


def test_truncate_prompt_tokens_keeps_the_last_tokens(smollm2_fp32):
    """vLLM's truncate_prompt_tokens: the request runs on the prompt's last k tokens, exactly."""
    tokenizer = smollm2_fp32.get_tokenizer()
    ids = tokenizer("One two three four five six seven eight nine ten eleven twelve").input_ids
    greedy = dict(temperature=0, max_tokens=6)
    cut = smollm2_fp32.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=5, **greedy),
                                use_tqdm=False)[0]
    direct = smollm2_fp32.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = smollm2_fp32.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=500, **greedy),
                                  use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    too_long = list(range(100, 2148))  # max_model_len is 2048
    with pytest.raises(ValueError, match="max_model_len is 2048"):
        smollm2_fp32.generate({"prompt_token_ids": too_long}, SamplingParams(**greedy), use_tqdm=False)
    out = smollm2_fp32.generate({"prompt_token_ids": too_long}, SamplingParams(truncate_prompt_tokens=100, **greedy),
                                use_tqdm=False)[0]
    assert out.prompt_token_ids == too_long[-100:] and len(out.outputs[0].token_ids) == 6


def test_chat_messages_are_read_as_the_chat_route_reads_them(smollm2_fp32):
    """`LLM.chat` takes OpenAI-style messages as the server does: text parts, no content,
    `developer`, an assistant's earlier tool calls; a malformed message is a ValueError naming it."""
    render = smollm2_fp32.apply_chat_template
    plain = render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}])
    parts = render([{"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}])
    assert parts == plain
    template = ("{% for m in messages %}[{{ m.role }}|{{ m.content }}"
                "{% for c in m.tool_calls or [] %}|{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}]"
                "{% endfor %}")
    called = render([{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                         "name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                     {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
                    add_generation_prompt=False, chat_template=template)
    assert called["prompt"] == "[user|Weather?][assistant||weather(Oslo)][tool|sunny]"
    assert render([{"role": "user", "content": None}], chat_template=template)["prompt"] == "[user|]"

    # Roles a template knows beyond OpenAI's, and arguments already an object, pass through.
    tool_turn = render([{"role": "ipython", "content": "42"},
                        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"city": "Rome"}}}]}],
                       add_generation_prompt=False, chat_template=template)
    assert tool_turn["prompt"] == "[ipython|42][assistant||f(Rome)]"
    with pytest.raises(ValueError, match=r"^messages\[1\]: expected a dict with a 'role'"):
        render([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: only text parts"):
        render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match=r"^messages\[0\]: a message needs 'content'"):
        render([{"role": "user"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]: expected a dict"):
        render(["hello"])
    with pytest.raises(ValueError, match="^messages: the chat template failed"):
        render([{"role": "user", "content": "a"}], chat_template="{% for m in messages %}{{ m.content }")
