"""lm-evaluation-harness as a real client: its `local-completions` model against the server (issue 16).

It scores log-likelihoods through /v1/completions with echo and logprobs,
and generates with stop sequences; the same tasks run through the
harness's own transformers model (`hf`, float32, the same weights) must give
the same scores and the same text. The tasks are local files, no download.
"""

from __future__ import annotations

from pathlib import Path

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from tests.conftest import whole_default_model_copy
from tests.openai.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["capitals_choice", "capitals_generate"]


def evaluate(model: str, model_args: dict) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        # Our two tasks alone: indexing the harness's thousands of its own took 18 s each time.
        task_manager=TaskManager(
            include_path=str(ROOT / "tests" / "openai" / "lm_eval_tasks"), include_defaults=False
        ),
        log_samples=True,
        bootstrap_iters=0,
    )


def per_sample(results: dict, task: str) -> list:
    return [
        sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])
    ]


def test_lm_eval_scores_through_the_server_equal_transformers_own(server, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task files name their data relative to the repository
    checkpoint = str(whole_default_model_copy())  # transformers' own model: every float weight
    served = evaluate(
        "local-completions",
        {
            "model": MODEL,
            "base_url": f"{server.url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": checkpoint,
            "num_concurrent": 2,
            "max_retries": 1,
        },
    )
    direct = evaluate("hf", {"pretrained": checkpoint, "dtype": "float32", "device": "cpu"})

    served_scores, direct_scores = (
        per_sample(served, "capitals_choice"),
        per_sample(direct, "capitals_choice"),
    )
    assert len(served_scores) == 6
    for served_choices, direct_choices in zip(served_scores, direct_scores, strict=True):
        for (served_loglik, served_greedy), (direct_loglik, direct_greedy) in zip(
            served_choices, direct_choices, strict=True
        ):
            assert served_loglik == pytest.approx(direct_loglik, abs=1e-3)
            assert served_greedy == direct_greedy
    accuracy = served["results"]["capitals_choice"]["acc,none"]
    assert accuracy == direct["results"]["capitals_choice"]["acc,none"] and accuracy > 0.5  # it knows some
    assert per_sample(served, "capitals_generate") == per_sample(direct, "capitals_generate")
    assert any(text for [text] in per_sample(served, "capitals_generate"))
