"""The `retrokv` lm-eval model: a task defined on local files runs through a BoundedCache, offline."""

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from eval.lm_eval_model import RetroKVLM  # noqa: E402

TASK = """task: retrokv_local_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
{extra}
metric_list:
  - metric: {metric}
"""


@pytest.fixture(scope="module")
def lm(tiny_backbone_for_lm):
    return RetroKVLM(pretrained=tiny_backbone_for_lm, policy="tova", budget=16, device="cpu", max_gen_toks=4)


@pytest.fixture(scope="module")
def tiny_backbone_for_lm(tmp_path_factory, tokenizer):
    from conftest import tiny_model

    folder = tmp_path_factory.mktemp("lm_backbone")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_local_tasks_run_through_the_engine(tmp_path, lm):
    data = tmp_path / "questions.jsonl"
    rows = [{"question": f"What is {i} plus {i}? Think about the numbers carefully before you answer.",
             "choices": [str(2 * i), str(2 * i + 1)], "answer": str(2 * i)} for i in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "mc.yaml").write_text(TASK.format(kind="multiple_choice", data=data, metric="acc",
                                                  extra="doc_to_choice: \"{{choices}}\"\ndoc_to_target: 0"))
    (tmp_path / "gen.yaml").write_text(TASK.format(
        kind="generate_until", data=data, metric="exact_match",
        extra="doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4"))
    results = simple_evaluate(model=lm, tasks=["retrokv_local_multiple_choice", "retrokv_local_generate_until"],
                              task_manager=TaskManager(include_path=str(tmp_path)), bootstrap_iters=0)
    scores = results["results"]
    assert 0.0 <= scores["retrokv_local_multiple_choice"]["acc,none"] <= 1.0
    assert 0.0 <= scores["retrokv_local_generate_until"]["exact_match,none"] <= 1.0


def test_loglikelihood_equals_a_plain_forward_when_the_budget_holds_everything(tiny_backbone_for_lm):
    lm = RetroKVLM(pretrained=tiny_backbone_for_lm, policy="window", budget=512, device="cpu")
    context, continuation = "The sky is", " blue today"
    (logprob, _greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    ids = lm.tokenizer(context + continuation, add_special_tokens=False).input_ids
    n = len(ids) - len(lm.tokenizer(context, add_special_tokens=False).input_ids)
    lm.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    expected = logp[-n:].gather(-1, torch.tensor(ids[-n:])[:, None]).sum()
    assert logprob == pytest.approx(float(expected), abs=1e-4)
