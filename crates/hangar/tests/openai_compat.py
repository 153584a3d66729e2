"""The official `openai` Python client against `hangar serve`.

Run by crates/hangar/tests/openai_python.rs against the built-in demo's
models (mock engines) behind an API key:

    python openai_compat.py BASE_URL API_KEY

BASE_URL ends in /v1. Every check prints one `ok:` line; the first failure
raises, printing a traceback, and the exit status is non-zero.

The mock engine's output is deterministic: output token i of a request is
a lowercase word chosen by hashing the prompt with i, tokens after the
first start with a space, and prompts are tokenized into runs of letters
and digits plus single punctuation marks. So the checks can state exact
token counts and compare streamed with non-streamed text.
"""

import math
import sys

import openai

SMALL = "demo/chat-small"
LARGE = "demo/chat-large"
EMBEDDING_DIMS = 384  # the `fast` preset's


def mock_tokens(text):
    """Token count of `text` by the mock engine's tokenizer."""
    count, in_word = 0, False
    for c in text:
        if c.isalnum():
            if not in_word:
                count += 1
            in_word = True
        else:
            in_word = False
            if not c.isspace():
                count += 1
    return count


def chat_prompt_tokens(messages):
    """Prompt tokens of a chat as the mock renders it (`<|role|>` turns)."""
    rendered = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return mock_tokens(rendered + "<|assistant|>\n")


def check_text(text, n):
    """`text` is `n` generated words: the first bare, the rest after a space."""
    words = text.split(" ")
    assert len(words) == n, f"expected {n} words, got {text!r}"
    assert all(w.isalpha() and w.islower() for w in words), f"unexpected output {text!r}"


def check_usage(usage, prompt, completion):
    got = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert got == (prompt, completion, prompt + completion), f"usage {usage} != {prompt} + {completion}"


def ok(what):
    print(f"ok: {what}", flush=True)


def main(base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    print(f"openai {openai.__version__} against {base_url}", flush=True)

    models = client.models.list()
    ids = sorted(m.id for m in models)
    assert ids == [LARGE, SMALL], ids
    assert all(m.object == "model" for m in models.data)
    ok("models.list")

    # The key holds a slash: the SDK sends it as one encoded segment.
    model = client.models.retrieve(SMALL)
    assert (model.id, model.object, model.owned_by) == (SMALL, "model", "hangar"), model
    try:
        client.models.retrieve("acme/no-such-model")
        raise AssertionError("an unknown model was retrieved")
    except openai.NotFoundError:
        pass
    ok("models.retrieve")

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, gateway! How are you?"},
    ]
    prompt = chat_prompt_tokens(messages)
    chat = client.chat.completions.create(model=SMALL, messages=messages, max_tokens=7)
    assert chat.object == "chat.completion" and chat.model == SMALL, chat
    assert len(chat.choices) == 1
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length", choice
    check_text(choice.message.content, 7)
    check_usage(chat.usage, prompt, 7)
    again = client.chat.completions.create(model=SMALL, messages=messages, max_completion_tokens=7)
    assert again.choices[0].message.content == choice.message.content, "the mock's text is deterministic"
    ok(f"chat.completions.create: {choice.message.content!r}, usage {prompt}+7")

    stream = client.chat.completions.create(
        model=SMALL,
        messages=messages,
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, roles, finish, usage = [], [], None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert roles == ["assistant"], roles
    assert "".join(pieces) == choice.message.content, (pieces, choice.message.content)
    assert len(pieces) == 7 and finish == "length", (pieces, finish)
    assert usage is not None, "include_usage sends a usage chunk"
    check_usage(usage, prompt, 7)
    ok("chat.completions.create(stream=True) matches the non-streamed text, with usage")

    text_prompt = "The quick brown fox jumps over the lazy dog."
    completion = client.completions.create(model=SMALL, prompt=text_prompt, max_tokens=5)
    assert completion.object == "text_completion", completion
    check_text(completion.choices[0].text, 5)
    assert completion.choices[0].finish_reason == "length"
    check_usage(completion.usage, mock_tokens(text_prompt), 5)
    ok(f"completions.create: {completion.choices[0].text!r}")

    streamed = client.completions.create(
        model=SMALL, prompt=text_prompt, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    for chunk in streamed:
        if chunk.usage is not None:
            usage = chunk.usage
        pieces.extend(c.text for c in chunk.choices if c.text)
    assert "".join(pieces) == completion.choices[0].text, pieces
    check_usage(usage, mock_tokens(text_prompt), 5)
    ok("completions.create(stream=True)")

    # No encoding_format: the client asks for base64 and decodes it.
    emb = client.embeddings.create(model=SMALL, input="hello embeddings")
    vector = emb.data[0].embedding
    assert len(vector) == EMBEDDING_DIMS, len(vector)
    assert abs(math.sqrt(sum(x * x for x in vector)) - 1.0) < 1e-3, "unit length"
    assert emb.usage.prompt_tokens == 2 and emb.usage.total_tokens == 2, emb.usage
    floats = client.embeddings.create(model=SMALL, input="hello embeddings", encoding_format="float")
    assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) for a, b in zip(vector, floats.data[0].embedding))
    batch = client.embeddings.create(model=SMALL, input=["first text", "second, longer text"], dimensions=64)
    assert [d.index for d in batch.data] == [0, 1]
    assert all(len(d.embedding) == 64 for d in batch.data)
    assert batch.usage.prompt_tokens == mock_tokens("first text") + mock_tokens("second, longer text")
    ok("embeddings.create (base64 default, float, batch with dimensions)")

    # The large demo model starts on its first request.
    cold = client.chat.completions.create(model=LARGE, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    check_text(cold.choices[0].message.content, 2)
    ok("chat.completions.create on a cold model")

    try:
        client.chat.completions.create(model="demo/none", messages=messages, max_tokens=1)
        raise AssertionError("an unknown model must fail")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and "demo/none" in e.message, e
    ok("unknown model -> openai.NotFoundError")

    wrong = openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0, timeout=60)
    try:
        wrong.models.list()
        raise AssertionError("a wrong API key must fail")
    except openai.AuthenticationError as e:
        assert e.status_code == 401 and "invalid API key" in e.message, e
    ok("wrong API key -> openai.AuthenticationError")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: openai_compat.py BASE_URL API_KEY")
    main(sys.argv[1], sys.argv[2])
