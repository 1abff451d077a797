"""kiln.LLM's vLLM-shaped API: prompt dicts in generate, conversations in chat."""

import pytest

import kiln

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
GREEDY = kiln.SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return kiln.LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=128,
                    num_kv_blocks=64)


def template_ids(llm, conversation, **kwargs):
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_a_conversation_is_the_templated_prompt(llm):
    [out] = llm.chat(CONVERSATION, GREEDY)
    assert out.prompt_token_ids == template_ids(llm, CONVERSATION)
    [ref] = llm.generate([template_ids(llm, CONVERSATION)], GREEDY)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_list_of_conversations_gives_one_output_each(llm):
    other = [{"role": "user", "content": "And a number?"}]
    outs = llm.chat([CONVERSATION, other], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [template_ids(llm, CONVERSATION),
                                                  template_ids(llm, other)]


def test_template_and_its_variables_can_be_given(llm):
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ suffix }}"
    [out] = llm.chat(CONVERSATION, GREEDY, chat_template=template,
                     chat_template_kwargs={"suffix": "go:"})
    expected = llm.tokenizer.encode("Be brief.|Name a colour.|go:", add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_tools_reach_the_template(llm):
    """As vLLM's LLM.chat(tools=...): the template describes them; no call is forced."""
    template = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    [out] = llm.chat(CONVERSATION, GREEDY, chat_template=template, tools=tools)
    expected = llm.tokenizer.encode("[get_weather]Be brief.|Name a colour.|",
                                    add_special_tokens=False)
    assert out.prompt_token_ids == expected
    [plain] = llm.chat(CONVERSATION, GREEDY, chat_template=template)
    assert plain.prompt_token_ids == llm.tokenizer.encode("Be brief.|Name a colour.|",
                                                          add_special_tokens=False)


@pytest.mark.parametrize("messages", [[], [[]], [CONVERSATION, []]])
def test_empty_conversations_are_clear_errors(llm, messages):
    with pytest.raises(ValueError, match="messages is empty"):
        llm.chat(messages, GREEDY)


def test_a_template_that_refuses_the_messages_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="chat template rejected these messages: no tools"):
        llm.chat(CONVERSATION, GREEDY, chat_template="{{ raise_exception('no tools') }}")


def test_a_model_without_a_template_says_how_to_give_one(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="chat_template="):
        llm.chat(CONVERSATION, GREEDY)


def test_vllm_prompt_dicts_are_prompts(llm):
    ids = llm.tokenizer.encode("Name a colour.")
    outs = llm.generate([{"prompt": "Name a colour."}, {"prompt_token_ids": ids}], GREEDY)
    [ref] = llm.generate(["Name a colour."], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [ids, ids]
    assert outs[0].prompt == "Name a colour." and outs[1].prompt is None
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids \
        == ref.outputs[0].token_ids
    [one] = llm.generate({"prompt_token_ids": ids}, GREEDY)  # a single dict is one prompt
    assert one.prompt_token_ids == ids


@pytest.mark.parametrize("prompt", [{"prompt": "x", "multi_modal_data": {}}, {}, {"text": "x"}])
def test_prompt_dicts_with_other_keys_are_refused_by_name(llm, prompt):
    with pytest.raises(ValueError, match="prompt dict holds one of"):
        llm.generate([prompt], GREEDY)
