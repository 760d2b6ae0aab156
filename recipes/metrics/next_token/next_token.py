"""Next-token metrics for causal language models: accuracy and perplexity.

Inputs are per token, already shifted so that prediction t is scored against reference t:
`predictions` (the argmax token), `references` (the label; -100 is ignored) and `nlls` (the
negative log-likelihood of the reference). perplexity = exp(mean nll) over scored tokens,
the exponential of the evaluation loss.
"""

import math

import datasets
import evaluate

_DESCRIPTION = __doc__
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of int, predicted token ids.
    references: list of int, label token ids; -100 marks tokens that are not scored.
    nlls: list of float, negative log-likelihood of each reference token.
Returns:
    accuracy: share of scored tokens predicted exactly.
    perplexity: exp of the mean negative log-likelihood over scored tokens.
    tokens: number of scored tokens.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class NextToken(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "predictions": datasets.Value("int64"),
                "references": datasets.Value("int64"),
                "nlls": datasets.Value("float64"),
            }),
        )

    def _compute(self, predictions, references, nlls):
        scored = [(p, r, n) for p, r, n in zip(predictions, references, nlls) if r != -100]
        if not scored:
            return {"accuracy": float("nan"), "perplexity": float("nan"), "tokens": 0}
        correct = sum(p == r for p, r, _ in scored)
        mean_nll = sum(n for _, _, n in scored) / len(scored)
        return {"accuracy": correct / len(scored), "perplexity": math.exp(mean_nll), "tokens": len(scored)}
