"""The lm-eval model type ``kvsieve``: found by name, every request type under eviction, checked against references."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from extras import require

lm_eval = require("lm_eval", "lm-eval")
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import kvsieve
from kvsieve.harness.eval.streaming import run_streaming
from kvsieve.harness.lmeval import KVSieveLM
from kvsieve.harness.lmeval.scoring import rolling_logprob
from kvsieve.harness.runners import LocalRunner
from kvsieve.runtime.compat import cache_argument
from kvsieve.selection.errors import PolicyError

CONTEXT = "The quick brown fox jumps over the lazy dog. The grass is green. The sky is blue. " * 3
PROMPT = CONTEXT + "Question: what is blue? Answer:"
CHOICES = [" The sky", " The grass is green", " apple", " blue"]
KVZIP = "kvzip+global"


def _lm(model_dir, **args: object) -> KVSieveLM:
    given = ",".join(f"{k}={v}" for k, v in ({"pretrained": model_dir} | args).items())
    return get_model("kvsieve").create_from_arg_string(given, {"device": "cuda:0", "batch_size": 1})


def _requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def _pair(tokenizer, context: str, continuation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """lm-eval's split: the whole text encoded, the continuation being what follows the context's tokens."""
    context_ids = tokenizer(context).input_ids
    whole = tokenizer(context + continuation).input_ids
    return torch.tensor([context_ids]), torch.tensor(whole[len(context_ids) :])


@pytest.fixture
def mc_task(tmp_path):
    """A local multiple-choice task of three questions (lm-eval's YAML + JSONL); its folder, for include_path."""
    docs = [{"context": PROMPT, "choices": CHOICES, "gold": i % 4} for i in range(3)]
    (tmp_path / "mc.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "mc.yaml").write_text(
        "task: kvsieve_test_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
        "metric_list:\n  - metric: acc\n    higher_is_better: true\n"
    )
    return tmp_path


def _expected_accuracy(model_dir, **args: object) -> float:
    """The task's accuracy computed from our own loglikelihoods (every question has the same choices)."""
    scores = [
        s for s, _ in _lm(model_dir, **args).loglikelihood(_requests("loglikelihood", [(PROMPT, c) for c in CHOICES]))
    ]
    return float(np.mean([int(np.argmax(scores)) == i % 4 for i in range(3)]))


def test_the_model_type_is_found_by_name_and_runs_a_local_task(model_dir, mc_task):
    from lm_eval.tasks import TaskManager

    assert get_model("kvsieve") is KVSieveLM
    out = lm_eval.simple_evaluate(
        model="kvsieve",
        model_args=f"pretrained={model_dir},policy=snapkv,rate=0.5",
        tasks=["kvsieve_test_mc"],
        task_manager=TaskManager(include_path=str(mc_task)),
        device="cpu",
    )
    expected = _expected_accuracy(model_dir, policy="snapkv", rate=0.5)
    assert out["results"]["kvsieve_test_mc"]["acc,none"] == pytest.approx(expected)


def test_kvsieve_lm_eval_is_lm_evals_own_command_line(model_dir, mc_task):
    from typer.testing import CliRunner

    from kvsieve.harness.cli import app

    args = ["lm-eval", "--model", "kvsieve", "--model_args", f"pretrained={model_dir},policy=full"]
    args += ["--tasks", "kvsieve_test_mc", "--include_path", str(mc_task), "--output_path", str(mc_task / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    [written] = (mc_task / "out").rglob("results_*.json")
    accuracy = json.loads(written.read_text())["results"]["kvsieve_test_mc"]["acc,none"]
    assert accuracy == pytest.approx(_expected_accuracy(model_dir, policy="full"))


def test_loglikelihood_equals_compress_then_a_teacher_forced_forward(model_dir, masked_reference):
    lm = _lm(model_dir, policy="snapkv", rate=0.5)
    got = lm.loglikelihood(_requests("loglikelihood", [(PROMPT, c) for c in CHOICES]))
    model = lm.model
    for (logprob, greedy), choice in zip(got, CHOICES, strict=True):
        context, continuation = _pair(lm.tokenizer, PROMPT, choice)
        cache = kvsieve.compress(model, context[:, :-1], "snapkv", rate=0.5)
        fed = torch.cat([context[:, -1:], continuation[None, :-1]], dim=-1)
        with torch.no_grad(), kvsieve.sieve_attention(model):
            logits = model(fed, **cache_argument(model, cache)).logits
        direct = F.log_softmax(logits.float(), -1)[0].gather(-1, continuation[:, None]).sum()
        assert logprob == pytest.approx(float(direct), abs=1e-4)
        assert greedy == bool((logits[0].argmax(-1) == continuation).all())
        kept = [cache.kept_positions(layer) for layer in range(len(cache.layers))]
        with masked_reference(model, context[:, :-1], kept) as ref, torch.no_grad():  # float64, full cache, masked
            masked = model(fed, **cache_argument(model, ref.cache)).logits
        reference = F.log_softmax(masked.double(), -1)[0].gather(-1, continuation[:, None]).sum()
        assert logprob == pytest.approx(float(reference), abs=1e-4)
    full = _lm(model_dir, policy="full").loglikelihood(_requests("loglikelihood", [(PROMPT, c) for c in CHOICES]))
    for (logprob, _), choice in zip(full, CHOICES, strict=True):  # nothing evicted: a plain forward of it all
        context, continuation = _pair(lm.tokenizer, PROMPT, choice)
        with torch.no_grad():
            logits = model(torch.cat([context, continuation[None]], dim=-1)).logits[0, context.shape[1] - 1 : -1]
        assert logprob == pytest.approx(float(F.log_softmax(logits, -1).gather(-1, continuation[:, None]).sum()), 1e-4)


def test_kv_bits_score_continuations_from_the_quantized_context(model_dir):
    lm = _lm(model_dir, policy="snapkv", rate=0.5, kv_bits=4, kv_group=8)
    got = lm.loglikelihood(_requests("loglikelihood", [(PROMPT, c) for c in CHOICES[:2]]))
    for (logprob, _), choice in zip(got, CHOICES, strict=False):
        context, continuation = _pair(lm.tokenizer, PROMPT, choice)
        cache = kvsieve.compress(lm.model, context[:, :-1], "snapkv", rate=0.5, kv_bits=4, kv_group=8)
        fed = torch.cat([context[:, -1:], continuation[None, :-1]], dim=-1)
        with torch.no_grad(), kvsieve.sieve_attention(lm.model):
            logits = lm.model(fed, **cache_argument(lm.model, cache)).logits
        assert logprob == pytest.approx(
            float(F.log_softmax(logits, -1)[0].gather(-1, continuation[:, None]).sum()), abs=1e-4
        )
    with pytest.raises(PolicyError, match="for quantization alone give a policy with rate=0"):
        _lm(model_dir, policy="full", kv_bits=4)
    with pytest.raises(PolicyError, match="does not divide the head dimension 16"):
        _lm(model_dir, policy="snapkv", rate=0.5, kv_bits=4, kv_group=5)


def test_choices_sharing_a_context_give_what_one_request_at_a_time_gives(model_dir):
    lm = _lm(model_dir, policy="trimkv+global:gates=untrained", rate=0.75)
    requests = _requests("loglikelihood", [(PROMPT, c) for c in CHOICES] + [(CONTEXT, " The sky")])
    together = lm.loglikelihood(requests)
    alone = [lm.loglikelihood([r])[0] for r in requests]
    for (a, greedy_a), (b, greedy_b) in zip(together, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-5) and greedy_a == greedy_b
    full = _lm(model_dir, policy="full").loglikelihood(requests)
    assert all(abs(a - f) > 1e-3 for (a, _), (f, _) in zip(together, full, strict=True))  # eviction did change them


def test_empty_and_short_contexts_that_fit_the_size_score_as_the_full_cache(model_dir):
    requests = _requests("loglikelihood", [("", " The sky is blue."), ("The", " sky"), (CONTEXT[:60], " The")])
    bounded = _lm(model_dir, policy="snapkv", max_tokens=48).loglikelihood(requests)
    full = _lm(model_dir, policy="full").loglikelihood(requests)
    for (ours, greedy), (theirs, greedy_full) in zip(bounded, full, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5) and greedy == greedy_full


def test_question_aware_loglikelihood_protects_the_question(model_dir):
    aware = _lm(model_dir, policy="snapkv", rate=0.5, question_aware="true")
    logprob, _ = aware.loglikelihood(_requests("loglikelihood", [(PROMPT, " The sky")]))[0]
    context, continuation = _pair(aware.tokenizer, PROMPT, " The sky")
    start = len(aware.tokenizer(PROMPT[: PROMPT.rfind("Question:")]).input_ids)
    question = context[:, start:]
    cache = kvsieve.compress(aware.model, context[:, :start], "snapkv", rate=0.5, question_ids=question[:, :-1])
    fed = torch.cat([question[:, -1:], continuation[None, :-1]], dim=-1)
    with torch.no_grad(), kvsieve.sieve_attention(aware.model):
        logits = aware.model(fed, **cache_argument(aware.model, cache)).logits
    assert logprob == pytest.approx(float(F.log_softmax(logits, -1)[0].gather(-1, continuation[:, None]).sum()), 1e-4)
    with pytest.raises(ValueError, match="no question marker"):
        aware.loglikelihood(_requests("loglikelihood", [(CONTEXT, " The sky")]))


def test_rolling_loglikelihood_is_the_streaming_protocol(model_dir):
    text = CONTEXT * 2
    bounded = _lm(model_dir, policy="snapkv", max_tokens=48, buffer=8)
    total = bounded.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))[0]
    ids = torch.tensor([[bounded.prefix_token_id, *bounded.tokenizer(text, add_special_tokens=False).input_ids]])
    protocol = run_streaming(LocalRunner(bounded.model), [("text", ids)], "snapkv", budgets=[48], buffer=8)
    run = next(r for r in protocol.runs if r.budget == 48)
    assert total == pytest.approx(-float(np.nansum(run.nll[0])), abs=1e-6)
    # the full cache: a plain forward of the whole document
    full = _lm(model_dir, policy="full").loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))[0]
    with torch.no_grad():
        logits = bounded.model(ids).logits
    plain = F.log_softmax(logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).sum()
    assert full == pytest.approx(float(plain), abs=1e-3)
    assert abs(total - full) > 0.1  # 48 entries of a ~150-token document: eviction changed the scores
    with pytest.raises(ValueError, match="give max_tokens= or max_bytes="):
        _lm(model_dir, policy="snapkv", rate=0.5).loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))


def test_generate_until_batches_prompts_and_honours_stops(model_dir):
    lm = _lm(model_dir, policy="snapkv", rate=0.5, batch_size=3)
    prompts = [PROMPT, CONTEXT[:90], CONTEXT[:150]]  # different lengths: one left-padded batch
    requests = _requests("generate_until", [(p, {"until": [], "max_gen_toks": 12}) for p in prompts])
    batched = lm.generate_until(requests)
    assert batched == [lm.generate_until([r])[0] for r in requests]
    for prompt, text in zip(prompts, batched, strict=True):
        ids = torch.tensor([lm.tokenizer(prompt).input_ids])
        out = kvsieve.generate(lm.model, ids, "snapkv", rate=0.5, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        assert text == lm.tokenizer.decode(out, skip_special_tokens=True)
        three = lm.generate_until(_requests("generate_until", [(prompt, {"until": [], "max_gen_toks": 3})]))
        assert three == [lm.tokenizer.decode(out[:3], skip_special_tokens=True)]
    free = batched[0]
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    stopped = lm.generate_until(_requests("generate_until", [(PROMPT, {"until": [stop], "max_gen_toks": 12})]))
    assert stopped == [free.split(stop)[0]] and len(stopped[0]) < len(free)


def _continuation_logprob(model, cache, context: torch.Tensor, continuation: torch.Tensor) -> tuple[float, bool]:
    """The last context token and the continuation fed through `cache` (what the context left): lm-eval's answer."""
    fed = torch.cat([context[:, -1:], continuation[None, :-1]], dim=-1)
    with torch.no_grad(), kvsieve.sieve_attention(model):
        logits = model(fed, **cache_argument(model, cache)).logits
    logprob = F.log_softmax(logits.float(), -1)[0].gather(-1, continuation[:, None]).sum()
    return float(logprob), bool((logits[0].argmax(-1) == continuation).all())


def test_kvzip_loglikelihood_equals_compress_with_the_tokenizer_then_a_forward(model_dir):
    lm = _lm(model_dir, policy=KVZIP, rate=0.75)
    got = lm.loglikelihood(_requests("loglikelihood", [(PROMPT, c) for c in CHOICES]))
    for (logprob, greedy), choice in zip(got, CHOICES, strict=True):
        context, continuation = _pair(lm.tokenizer, PROMPT, choice)
        cache = kvsieve.compress(lm.model, context[:, :-1], KVZIP, rate=0.75, tokenizer=lm.tokenizer)
        assert cache.mean_stored() < 0.5 * context.shape[1]  # evicted for real
        expected, expected_greedy = _continuation_logprob(lm.model, cache, context, continuation)
        assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    full = _lm(model_dir, policy="full").loglikelihood(_requests("loglikelihood", [(PROMPT, c) for c in CHOICES]))
    assert all(abs(a - f) > 1e-3 for (a, _), (f, _) in zip(got, full, strict=True))


def test_sentence_loglikelihood_reads_the_sentences_with_the_models_tokenizer(model_dir):
    """The policy's parameters come through lm-eval's comma split as arguments of their own and join its spec."""
    policy = "snapkv:projection=sentence,best_tokens=0.1"
    lm = _lm(model_dir, policy=policy, rate=0.6)
    assert lm.args.policy == policy and lm.config.resolved.name == policy
    got = lm.loglikelihood(_requests("loglikelihood", [(PROMPT, c) for c in CHOICES]))
    for (logprob, greedy), choice in zip(got, CHOICES, strict=True):
        context, continuation = _pair(lm.tokenizer, PROMPT, choice)
        spans = kvsieve.sentence_spans(lm.tokenizer, context[0, :-1])
        cache = kvsieve.compress(lm.model, context[:, :-1], policy, rate=0.6, spans=spans)
        expected, expected_greedy = _continuation_logprob(lm.model, cache, context, continuation)
        assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy


def test_kvzip_generation_is_kvsieve_generate_with_the_tokenizer(model_dir):
    prompts = [PROMPT, CONTEXT[:150]]  # different lengths: one left-padded batch
    requests = _requests("generate_until", [(p, {"until": [], "max_gen_toks": 8}) for p in prompts])
    # a size: the prompt is compressed to it, and generation grows past it (kvzip cannot re-score while generating)
    for budget in ({"rate": 0.5}, {"max_tokens": 40}):
        lm = _lm(model_dir, policy=KVZIP, batch_size=2, **budget)
        for prompt, text in zip(prompts, lm.generate_until(requests), strict=True):
            ids = torch.tensor([lm.tokenizer(prompt).input_ids])
            out = kvsieve.generate(
                lm.model, ids, KVZIP, tokenizer=lm.tokenizer, max_new_tokens=8, do_sample=False, **budget
            )
            assert text == lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), budget


def test_kvzip_rolling_loglikelihood_evicts_as_a_chunked_compress(model_dir):
    lm = _lm(model_dir, policy=KVZIP, max_tokens=48, buffer=8)
    total = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(CONTEXT,)]))[0]
    ids = torch.tensor([[lm.prefix_token_id, *lm.tokenizer(CONTEXT, add_special_tokens=False).input_ids]])
    expected = 0.0
    for start in range(0, ids.shape[1], 8):  # each chunk after what compress(chunk=8) keeps of the ones before it
        piece, targets = ids[:, start : start + 8], ids[0, start + 1 : start + 9]
        fed = {}
        if start:
            cache = kvsieve.compress(lm.model, ids[:, :start], KVZIP, max_tokens=48, chunk=8, tokenizer=lm.tokenizer)
            fed = cache_argument(lm.model, cache)
        with torch.no_grad(), kvsieve.sieve_attention(lm.model):
            logits = lm.model(piece, **fed).logits
        expected += float(F.log_softmax(logits[0, : len(targets)], -1).gather(-1, targets[:, None]).sum())
    assert cache.mean_stored() < 0.6 * start  # the reference evicted too
    assert total == pytest.approx(expected, abs=1e-4)
    full = _lm(model_dir, policy="full").loglikelihood_rolling(_requests("loglikelihood_rolling", [(CONTEXT,)]))[0]
    assert abs(total - full) > 0.1
    with pytest.raises(PolicyError, match="give the tokenizer"):
        rolling_logprob(lm.model, lm.config, ids, 8)


def test_the_entry_point_names_the_class_its_decorator_registers():
    """lm-eval's plugin loading (EleutherAI/lm-evaluation-harness#4013) registers the entry point as a placeholder
    under `kvsieve`; importing the module then registers the class again, which lm-eval accepts only when the entry
    point's value is exactly `module:Class` of the decorated class."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import EntryPoint

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    value = project.get("entry-points", {}).get("lm_eval.models", {}).get("kvsieve")
    assert value == f"{KVSieveLM.__module__}:{KVSieveLM.__name__}"
    assert EntryPoint("kvsieve", value, "lm_eval.models").load() is KVSieveLM is get_model("kvsieve")


_REGISTRY_REPORT = """
    import json
    from lm_eval.api.registry import get_model, model_registry
    from kvsieve.harness.lmeval import KVSieveLM

    names = set(model_registry)  # before a lookup below imports lm_eval.models (which registers lm-eval's types)
    found = {"dummy": get_model("dummy").__name__, "kvsieve": get_model("kvsieve") is KVSieveLM}
    try:  # found by name; its module imports accelerate, which only lm-eval's hf extra installs
        found["hf"] = get_model("hf").__name__
    except ModuleNotFoundError as missing:
        found["hf"] = f"HFLM needs {missing.name}"
    from lm_eval.models import MODEL_MAPPING

    print(json.dumps(found | {"missing": sorted(set(MODEL_MAPPING) - names)}))
"""


@pytest.mark.parametrize(
    "first",
    [
        "import kvsieve.harness.lmeval.model",
        # another package registered a model type first: lm-eval's registry is no longer empty
        "from lm_eval.api.registry import register_model\nfrom lm_eval.api.model import LM\n"
        "register_model('other')(type('Other', (LM,), {}))\nimport kvsieve.harness.lmeval",
    ],
    ids=["kvsieve-first", "after-another-plugin"],
)
def test_registering_kvsieve_hides_none_of_lm_evals_model_types(first):
    code = first + "\n" + textwrap.dedent(_REGISTRY_REPORT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.pop("hf") in ("HFLM", "HFLM needs accelerate")
    assert report == {"missing": [], "dummy": "DummyLM", "kvsieve": True}


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ({"policy": "nosuch", "rate": 0.5}, PolicyError, "nosuch"),
        ({"rate": 0.5}, ValueError, "needs policy="),
        ({"policy": "snapkv", "rate": 0.5, "max_tokens": 64}, PolicyError, "rate"),
        ({"policy": "full", "rate": 0.5}, PolicyError, "keeps every entry"),
        ({"policy": "full", "projection": "sentence"}, PolicyError, "takes no policy parameters"),
        ({"policy": "snapkv", "rate": 0.5, "best_tokens": 0.1}, PolicyError, "best_tokens is a parameter of"),
        ({"policy": "snapkv", "rate": 0.5, "colour": "red"}, ValueError, "unknown argument"),
        ({"policy": "snapkv", "rate": 0.5, "device": "cuda:3"}, ValueError, "device"),
        ({"policy": "snapkv", "rate": 0.5, "dtype": "int3"}, ValueError, "unknown dtype"),
        ({"policy": "trimkv+global", "rate": 0.5}, Exception, "ships no retention gates"),
    ],
)
def test_bad_model_args_are_named_before_any_work(model_dir, args, error, match):
    with pytest.raises(error, match=match):
        _lm(model_dir, **args)


def test_an_unknown_model_and_a_request_too_long_are_named(model_dir):
    with pytest.raises(kvsieve.ModelNotFoundError):
        _lm(model_dir / "nowhere", policy="snapkv", rate=0.5)
    lm = _lm(model_dir, policy="snapkv", rate=0.5)
    long = "The sky is blue. " * 400  # past the tiny model's 1,024 positions
    with pytest.raises(ValueError, match="more than the model's context of 1024"):
        lm.loglikelihood(_requests("loglikelihood", [(PROMPT, " x"), (long, " x")]))
    with pytest.raises(ValueError, match="more than the model's context"):
        lm.generate_until(_requests("generate_until", [(long, {"until": ["."]})]))


@pytest.mark.integration
def test_default_model_loglikelihood_equals_compress_then_a_forward():
    lm = get_model("kvsieve").create_from_arg_obj(
        {"pretrained": "smollm2-135m", "policy": "trimkv+global", "rate": 0.75}
    )
    from kvsieve.harness.data.essays import essay_texts

    prompt = next(iter(essay_texts(["gap"]).values()))[:1500] + "\n\nQuestion: what is the essay about? Answer:"
    choices = [" Wealth.", " The gap between rich and poor.", " Cooking."]
    got = lm.loglikelihood(_requests("loglikelihood", [(prompt, c) for c in choices]))
    for (logprob, _), choice in zip(got, choices, strict=True):
        context, continuation = _pair(lm.tokenizer, prompt, choice)
        cache = kvsieve.compress(lm.model, context[:, :-1], "trimkv+global", rate=0.75)
        assert cache.mean_stored() < 0.5 * context.shape[1]  # evicted for real
        fed = torch.cat([context[:, -1:], continuation[None, :-1]], dim=-1)
        with torch.no_grad(), kvsieve.sieve_attention(lm.model):
            logits = lm.model(fed, **cache_argument(lm.model, cache)).logits
        direct = F.log_softmax(logits.float(), -1)[0].gather(-1, continuation[:, None]).sum()
        assert logprob == pytest.approx(float(direct), abs=1e-4)
