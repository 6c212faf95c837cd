"""The official `openai` Python client against the real `moeserve serve`.

scripts/test.sh runs this with pytest from a venv under target/e2e-venv holding the pinned
`openai` package. The fixture makes a tiny model with the binary, starts the server on
127.0.0.1 with port 0 (the address is read from its log), and stops it at the end.
Environment: MOESERVE_BIN (default target/release/moeserve).
"""

import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("MOESERVE_BIN", ROOT / "target" / "release" / "moeserve"))
API_KEY = "sk-python-e2e"
START_TIMEOUT_S = 120

# Loopback only: never route these requests through a proxy from the environment.
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"


class RunningServer:
    """`moeserve serve` on 127.0.0.1:0; its stderr is drained into `lines`."""

    def __init__(self, model: Path, extra_args: tuple = ()):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [BIN, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
             "--api-key", API_KEY, *extra_args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )
        self.address = threading.Event()
        self.base = ""
        threading.Thread(target=self._drain, daemon=True).start()
        if not self.address.wait(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError("no address printed:\n" + "\n".join(self.lines))
        self._wait_healthy()

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            found = re.search(r"listening on (http://[^\s\"]+)", line)
            if found and not self.address.is_set():
                self.base = found.group(1)
                self.address.set()

    def _wait_healthy(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server not healthy:\n" + "\n".join(self.lines))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def preset_server(tmp_path_factory, preset: str, name: str, make_timeout_s: int = 120) -> RunningServer:
    """`moeserve serve` on a fresh `make-model --preset` checkpoint in a directory `name` (the
    served model's name)."""
    assert BIN.exists(), f"{BIN} is missing: cargo build --release --bin moeserve"
    model = tmp_path_factory.mktemp("model") / name
    subprocess.run(
        [BIN, "make-model", "--preset", preset, "--out", model],
        check=True, capture_output=True, timeout=make_timeout_s,
    )
    return RunningServer(model)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = preset_server(tmp_path_factory, "mixtral-tiny", "tiny")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    """A Qwen3-MoE preset with Qwen3-30B-A3B's routing shape (128 experts top-8 per layer)."""
    running = preset_server(tmp_path_factory, "qwen3-moe-tiny", "qwen3")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def deepseek_server(tmp_path_factory):
    """DeepSeek-V2-Lite's exact shapes, 2 layers (the first dense): MLA, 64 experts top-6, 2 shared."""
    running = preset_server(tmp_path_factory, "deepseek-v2-lite-2l", "deepseek", make_timeout_s=300)
    yield running
    running.stop()


HARMONY_FIXTURE = ROOT / "tests" / "fixtures" / "gpt-oss-harmony"


@pytest.fixture(scope="module")
def harmony_server():
    """The GPT-OSS fixture whose weights answer in the harmony format: reasoning on the
    analysis channel, then the answer on the final channel (tests/reference/gpt_oss_harmony.py)."""
    running = RunningServer(HARMONY_FIXTURE)
    yield running
    running.stop()


DEMO_MODEL = Path(os.environ.get("MOESERVE_DEMO_MODEL", ROOT / "models" / "smolmoe-8x135m"))


@pytest.fixture(scope="module")
def demo_server():
    """The demo model (SmolLM2-135M-Instruct upcycled; made by models/smolmoe-8x135m.sh, which
    scripts/test.sh runs first)."""
    assert (DEMO_MODEL / "config.json").exists(), f"{DEMO_MODEL} is missing: run models/smolmoe-8x135m.sh"
    running = RunningServer(DEMO_MODEL)
    yield running
    running.stop()


def make_client(server, api_key=API_KEY):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=api_key, max_retries=0,
                         timeout=60)


def test_streams_a_chat_completion(server):
    client = make_client(server)
    messages = [{"role": "user", "content": "hi"}]
    common = dict(model="tiny", messages=messages, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **common)
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert finish == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + 8

    plain = client.chat.completions.create(**common)
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == content
    assert plain.usage.completion_tokens == 8


def test_streams_a_completion(server):
    client = make_client(server)
    common = dict(model="tiny", prompt="Hello, world", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream=True, **common))
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    plain = client.completions.create(**common)
    assert plain.choices[0].text == text
    assert plain.usage.prompt_tokens == 12 and plain.usage.completion_tokens == 6


def test_lists_the_served_model(server):
    models = make_client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_errors_raise_the_matching_exceptions(server):
    client = make_client(server)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=messages, temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.AuthenticationError):
        make_client(server, api_key="sk-wrong").models.list()


def test_a_qwen3_moe_model_answers_and_shows_its_128_experts(qwen3_server):
    client = make_client(qwen3_server)
    common = dict(model="qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                  temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(stream=True, **common))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(**common)
    assert plain.usage.completion_tokens == 6
    assert plain.choices[0].message.content == content
    request = urllib.request.Request(qwen3_server.base + "/v1/moe/load",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        load = json.load(r)
    assert load["placement"]["num_experts"] == 128
    assert len(load["layers"]) == 2
    assert all(len(layer["cumulative_load"]) == 128 for layer in load["layers"])
    # Every step routed each of its tokens to 8 of the 128 experts in both layers.
    assert all(sum(layer["cumulative_load"]) % 8 == 0 and sum(layer["cumulative_load"]) > 0
               for layer in load["layers"])


def test_a_deepseek_v2_lite_model_answers_and_shows_its_shared_experts_apart(deepseek_server):
    client = make_client(deepseek_server)
    common = dict(model="deepseek", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                  temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(stream=True, **common))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(**common)
    assert plain.usage.completion_tokens == 5
    assert plain.choices[0].message.content == content
    # The start-up log gives the latent cache's size: 2 layers × (512 + 64) f32 values.
    assert any("4608 bytes per token: latent 512 + rope 64" in line for line in deepseek_server.lines)
    request = urllib.request.Request(deepseek_server.base + "/v1/moe/load",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        load = json.load(r)
    assert load["placement"]["num_experts"] == 64
    (layer,) = load["layers"]  # layer 0 is dense
    assert len(layer["cumulative_load"]) == 64
    # Routed pairs (6 per token) count the routed experts only; every token also went through
    # the shared experts, counted apart.
    assert sum(layer["cumulative_load"]) == layer["pairs"] > 0
    assert layer["pairs"] == 6 * layer["shared_expert_tokens"]


def _prompt_tokens(client, text):
    reply = client.completions.create(model="gpt-oss-harmony", prompt=text, max_tokens=1)
    return reply.usage.prompt_tokens


def test_a_gpt_oss_reply_comes_back_split_into_reasoning_and_content(harmony_server):
    manifest = json.loads((HARMONY_FIXTURE / "manifest.json").read_text())
    cases = json.loads((HARMONY_FIXTURE / "chat_cases.json").read_text())
    client = make_client(harmony_server)
    for case in cases:
        common = dict(model="gpt-oss-harmony", messages=case["messages"], temperature=0)
        if "reasoning_effort" in case:
            common["reasoning_effort"] = case["reasoning_effort"]
        plain = client.chat.completions.create(**common)
        choice = plain.choices[0]
        assert choice.message.content == manifest["answer"]
        assert choice.message.reasoning_content == manifest["reasoning"]
        # The model stopped on <|return|>, after exactly the tokens transformers gave.
        assert choice.finish_reason == "stop"
        assert plain.usage.completion_tokens == len(case["greedy_ids"])
        # The template states today's date (UTC), which may tokenize unlike the fixture's.
        fixture_date = re.search(r"Current date: (\d{4}-\d{2}-\d{2})", case["rendered"])[1]
        today = time.strftime("%Y-%m-%d", time.gmtime())
        shift = (_prompt_tokens(client, f"Current date: {today}\n\n")
                 - _prompt_tokens(client, f"Current date: {fixture_date}\n\n"))
        assert plain.usage.prompt_tokens == len(case["ids"]) + shift

        chunks = list(client.chat.completions.create(stream=True, **common))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
        content = [d.content or "" for d in deltas]
        assert "".join(reasoning) == manifest["reasoning"]
        assert "".join(content) == manifest["answer"]
        # The reasoning streams first, then the answer; no chunk mixes them.
        last_reasoning = max(i for i, r in enumerate(reasoning) if r)
        first_content = min(i for i, c in enumerate(content) if c)
        assert last_reasoning < first_content
        assert not any(r and c for r, c in zip(reasoning, content))


# Nested, with bounds on every list and string so that a greedy model that repeats itself still
# ends inside max_tokens: the schema decides where the output stops.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                    "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "kind": {"enum": ["house", "flat", "boat"]},
            },
            "required": ["city", "kind"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "hobbies", "address"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
SUBJECTS = ["a sailor", "a baker", "a pilot", "a nurse", "a farmer", "a painter", "a chemist",
            "a poet", "a judge", "a miner", "a tailor", "a diver", "a chef", "a monk", "a clown",
            "a drummer", "a smith", "a guard", "a priest", "a hunter"]


def _person_reply(client, model, subject, stream):
    messages = [{"role": "user", "content": f"Describe {subject} as a JSON person record."}]
    common = dict(model=model, messages=messages, max_tokens=200, temperature=0,
                  response_format=JSON_SCHEMA_FORMAT)
    if not stream:
        reply = client.chat.completions.create(**common)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **common))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def test_json_schema_replies_validate_for_twenty_prompts_streamed_and_not(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    jobs = [(subject, stream) for subject in SUBJECTS for stream in (False, True)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(lambda job: _person_reply(client, model, *job), jobs))
    for (subject, stream), (text, finish) in zip(jobs, replies):
        assert finish == "stop", (subject, stream, text)
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    # Greedy and constrained the same way, a stream says what the plain reply says.
    for i in range(0, len(jobs), 2):
        assert replies[i][0] == replies[i + 1][0], jobs[i]


def test_completions_take_vllm_constraints(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    date = client.completions.create(model=model, prompt="The date today is", max_tokens=30,
                                     temperature=0,
                                     extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    text = date.choices[0].text
    assert len(text) == 10 and text[4] == text[7] == "-", text
    assert date.choices[0].finish_reason == "stop"
    choice = client.completions.create(
        model=model, prompt="Is water wet? Answer:", max_tokens=10, temperature=0.8, seed=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].text in {"yes", "no", "maybe"}
    listed = client.completions.create(
        model=model, prompt="Three colours:", max_tokens=60, temperature=0,
        extra_body={"guided_grammar": 'root ::= "[" item "," item "," item "]"\nitem ::= [a-z]{1,8}'})
    text = listed.choices[0].text
    assert text.startswith("[") and text.endswith("]"), text
    items = text[1:-1].split(",")
    assert len(items) == 3 and all(i.isalpha() and i.islower() for i in items), text


def test_json_object_and_invalid_schemas(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a JSON object."}],
        max_tokens=120, temperature=0.7, seed=1, response_format={"type": "json_object"})
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict), content
    else:
        assert content.lstrip().startswith("{"), content
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}})
    assert bad.value.param == "response_format.json_schema.schema"
    assert "nope" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x",
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert bad.value.param == "guided_choice"


def test_random_weights_answer_valid_json_because_of_the_constraint(harmony_server):
    """The GPT-OSS fixture's weights never make JSON on their own: the constraint does, from the
    final channel on (the analysis channel before it stays free, as vLLM's reasoning parser
    leaves it)."""
    client = make_client(harmony_server)
    messages = [{"role": "user", "content": "hello"}]
    free = client.chat.completions.create(model="gpt-oss-harmony", messages=messages,
                                          temperature=1.0, seed=5, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content or "")
    for seed in range(5):
        reply = client.chat.completions.create(
            model="gpt-oss-harmony", messages=messages, temperature=1.0, seed=seed,
            max_tokens=300, response_format=JSON_SCHEMA_FORMAT)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON_SCHEMA)
        # The constraint applies from the final channel on: the reasoning before it is free.
        assert reply.choices[0].message.reasoning_content, reply.choices[0].message


def test_logit_bias_bans_and_forces_tokens(server):
    client = make_client(server)
    common = dict(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})

    def tokens(bias):
        return client.completions.create(**common, logit_bias=bias).choices[0].logprobs.tokens

    plain = tokens(None)
    forced = tokens({"9": 100})
    assert forced == [forced[0]] * 4 and forced != plain
    # Banned, token 9 gives way to the next one forced.
    other = tokens({"9": -100, "10": 100, "11": 100})
    assert forced[0] not in other
    with pytest.raises(openai.BadRequestError) as bad:
        tokens({"999999": 1})
    assert bad.value.param == "logit_bias"


def test_unimplemented_fields_are_refused_not_ignored(server):
    client = make_client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="hi", suffix="end")
    assert bad.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       modalities=["text", "audio"])
    assert bad.value.param == "modalities"
    # The neutral values clients send by default pass.
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, modalities=["text"], store=False)
    assert reply.choices[0].message.role == "assistant"


def _post(server, path, body):
    request = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)


def test_tokenize_round_trips_with_detokenize_and_counts_as_requests_do(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    text = "The quick brown fox jumps over the lazy dog, twice: ünïcode too."
    tokenized = _post(demo_server, "/tokenize", {"model": model, "prompt": text,
                                                 "return_token_strs": True})
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) > 0
    assert tokenized["max_model_len"] == client.models.list().data[0].max_model_len
    assert _post(demo_server, "/detokenize", {"model": model, "tokens": tokenized["tokens"]}) \
        == {"prompt": text}
    completion = client.completions.create(model=model, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == tokenized["count"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat_tokens = _post(demo_server, "/tokenize", {"model": model, "messages": messages})
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == chat_tokens["count"]
    rendered = _post(demo_server, "/detokenize", {"tokens": chat_tokens["tokens"]})["prompt"]
    assert "Be brief." in rendered and text in rendered


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                       "required": ["zone"], "additionalProperties": False}}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in TOOL_SCHEMAS, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_required_and_named_tool_calls_parse_streamed_and_not(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    common = dict(model=model, messages=messages, tools=TOOLS, max_tokens=120, temperature=0)
    reply = client.chat.completions.create(tool_choice="required", **common)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls)

    chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **common))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # As OpenAI streams calls: the first entry of a call has its id and name, the later ones
    # pieces of its arguments; a client joins them by index.
    streamed = {}
    pieces = 0
    for entry in (call for d in deltas for call in (d.tool_calls or [])):
        if entry.id:
            assert entry.index == len(streamed) and entry.function.name
            streamed[entry.index] = [entry.function.name, ""]
        streamed[entry.index][1] += entry.function.arguments or ""
        pieces += 1
    assert pieces > 2 * len(streamed), "the arguments came in pieces"
    assert [tuple(v) for v in streamed.values()] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **common)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_calls([call])
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False,
                                            **common)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_conversation_with_a_tool_result_continues(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=20, temperature=0)
    assert answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The tool turn is in the prompt: it is longer than the first request's.
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_tool_choice_needs_the_server_flags(demo_server):
    client = make_client(demo_server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=DEMO_MODEL.name, tools=TOOLS,
                                       messages=[{"role": "user", "content": "hi"}])
    assert bad.value.param == "tool_choice"
    assert "--enable-auto-tool-choice" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=DEMO_MODEL.name, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert bad.value.param == "tool_choice"


def _metric(server, name):
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_n_choices_share_the_prompt_and_come_back_indexed(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    # Choices 2 and 3 are forked from choice 1's KV blocks once it has computed the prompt.
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman " \
             "who told stories to the children every evening about the " + "deep blue water " * 4
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    pairs_per_token = config["num_hidden_layers"] * config["num_experts_per_tok"]  # all sparse
    hits_before = _metric(demo_server, "moeserve:prefix_cache_hits_total")
    pairs_before = _metric(demo_server, "moeserve:moe_pairs_total")
    reply = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=12,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    prompt_tokens = reply.usage.prompt_tokens
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1, "seeds seed, seed+1, seed+2 differ"
    assert reply.usage.completion_tokens == 36
    # Tokens through the model: the prompt once (less what an earlier request left cached),
    # then 11 fed-back tokens per choice.
    hits = _metric(demo_server, "moeserve:prefix_cache_hits_total") - hits_before
    computed = (_metric(demo_server, "moeserve:moe_pairs_total") - pairs_before) / pairs_per_token
    assert computed == prompt_tokens - hits + 3 * 11, (computed, prompt_tokens, hits)
    # Choice i is the same as a single request with seed + i.
    for i, choice in enumerate(reply.choices):
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                          temperature=1.0, seed=7 + i,
                                          extra_body={"ignore_eos": True})
        assert alone.choices[0].text == choice.text

    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], n=3,
        max_tokens=8, temperature=1.0, seed=3, stream=True,
        stream_options={"include_usage": True}))
    texts = ["", "", ""]
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], n=3,
        max_tokens=8, temperature=1.0, seed=3)
    assert [c.message.content for c in plain.choices] == texts
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_best_of_returns_the_likeliest(demo_server):
    client = make_client(demo_server)
    model = DEMO_MODEL.name
    common = dict(model=model, prompt="The capital of France is", max_tokens=6, temperature=1.0,
                  seed=11, logprobs=0, extra_body={"ignore_eos": True})
    best = client.completions.create(best_of=4, n=2, **common)
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 24  # every sequence generated is counted
    every = client.completions.create(n=4, **common)
    totals = sorted((sum(c.logprobs.token_logprobs) for c in every.choices), reverse=True)
    got = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert got == pytest.approx(totals[:2])
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(best_of=2, n=3, **common)
    assert bad.value.param == "best_of"


def test_routed_experts_come_back_per_token_streamed_and_not(qwen3_server):
    client = make_client(qwen3_server)
    common = dict(model="qwen3", prompt=[5, 6, 7, 8, 9], max_tokens=4, temperature=0,
                  extra_body={"ignore_eos": True, "return_routed_experts": "prompt"})
    plain = client.completions.create(**common)
    choice = plain.choices[0].model_dump()
    generated, prompt = choice["routed_experts"], choice["prompt_routed_experts"]
    assert len(generated) == 4 and len(prompt) == 4  # prompt positions but the last
    for token in generated + prompt:
        assert len(token) == 2  # MoE layers
        assert all(len(chosen) == 8 and len(set(chosen)) == 8 for chosen in token)
        assert all(0 <= e < 128 for chosen in token for e in chosen)
    chunks = list(client.completions.create(stream=True, **common))
    streamed = [e for c in chunks for ch in c.choices
                for e in (ch.model_dump().get("routed_experts") or [])]
    assert streamed == generated
    firsts = [ch.model_dump().get("prompt_routed_experts") for c in chunks for ch in c.choices]
    assert firsts[0] == prompt and not any(firsts[1:])
    # Not asked for, nothing is added.
    bare = client.completions.create(model="qwen3", prompt=[5, 6, 7], max_tokens=2)
    assert "routed_experts" not in bare.choices[0].model_dump(exclude_unset=True)


def test_gpt_oss_auto_tool_choice_keeps_a_reply_without_calls_as_it_was():
    """With the harmony parser on, a reply that calls nothing is the same reasoning and answer
    (the fixture's template renders no tools; the call parsing itself is tested in
    crates/moeserve-text/tests/harmony.rs)."""
    server = RunningServer(HARMONY_FIXTURE, ("--enable-auto-tool-choice", "--tool-call-parser",
                                             "openai"))
    try:
        manifest = json.loads((HARMONY_FIXTURE / "manifest.json").read_text())
        case = json.loads((HARMONY_FIXTURE / "chat_cases.json").read_text())[0]
        client = make_client(server)
        common = dict(model="gpt-oss-harmony", messages=case["messages"], temperature=0,
                      tools=TOOLS)
        reply = client.chat.completions.create(**common)
        assert reply.choices[0].message.content == manifest["answer"]
        assert reply.choices[0].message.reasoning_content == manifest["reasoning"]
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(stream=True, **common))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == manifest["answer"]
    finally:
        server.stop()
