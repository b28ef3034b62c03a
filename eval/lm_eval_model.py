"""An lm-eval-harness model, `retrokv`, that runs any lm-eval task through a BoundedCache.

    lm_eval --model retrokv --model_args snapshot=outputs/RUN,budget=512 --tasks gsm8k \
        --include_path ... (with `import eval.lm_eval_model` done, e.g. python -m eval.lm_eval_model ...)
    lm_eval.simple_evaluate(model=RetroKVLM(pretrained="smollm2-135m", policy="tova", budget=256), tasks=[...])

`pretrained` is the backbone for the training-free policies; `snapshot` (a snapshot or run folder) loads a
gated model, whose learned policy is used unless `policy` names another. Every request is scored or
generated with a fresh cache, so its memory is bounded by `budget` whatever the context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from eval.engine import BoundedCache


@register_model("retrokv")
class RetroKVLM(LM):
    def __init__(self, pretrained: str = "smollm2-135m", snapshot: str | None = None, policy: str | None = None,
                 budget: int = 512, chunk_size: int | None = None, device: str = "auto", dtype: str = "float32",
                 max_gen_toks: int = 256, batch_size: int | str = 1, **_):
        super().__init__()
        from eval.sweep import resolve_device

        self._device = resolve_device(device)
        if snapshot:
            from checkpoints import load_snapshot
            from eval.quick import resolve_snapshot

            self.model, self.tokenizer, meta = load_snapshot(resolve_snapshot(snapshot), dtype=dtype, device=self._device)
            self.policy = policy or meta.gate_kind
        else:
            from models import load_backbone

            self.model, self.tokenizer = load_backbone(pretrained, dtype=dtype, device=self._device)
            self.policy = policy or "tova"
        self.budget, self.chunk_size, self.max_gen_toks = int(budget), chunk_size and int(chunk_size), int(max_gen_toks)

    def _cache(self) -> BoundedCache:
        return BoundedCache(self.model, policy=self.policy, budget=self.budget, chunk_size=self.chunk_size)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @torch.no_grad()
    def _continuation_logprobs(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        ids = torch.tensor([context + continuation], device=self._device)
        with self._cache() as cache:
            logits = self.model(input_ids=ids[:, :-1], cache=cache, use_cache=True).logits[0, -len(continuation):]
        logp = F.log_softmax(logits.float(), -1)
        target = torch.tensor(continuation, device=self._device)
        return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for request in tqdm(requests, desc="retrokv loglikelihood"):
            context, continuation = request.args
            whole, head = self._encode(context + continuation), self._encode(context)
            if not head:  # an empty context: predict from the end-of-text token
                head, whole = [self.tokenizer.eos_token_id], [self.tokenizer.eos_token_id] + whole
            out.append(self._continuation_logprobs(head, whole[len(head):] or self._encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in tqdm(requests, desc="retrokv rolling loglikelihood"):
            (text,) = request.args
            out.append(self._continuation_logprobs([self.tokenizer.eos_token_id], self._encode(text))[0])
        return out

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        out = []
        for request in tqdm(requests, desc="retrokv generate"):
            context, kwargs = request.args
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sampling = {"do_sample": bool(kwargs.get("do_sample", False))}
            if sampling["do_sample"]:
                sampling["temperature"] = float(kwargs.get("temperature", 1.0))
            ids = torch.tensor([self._encode(context)], device=self._device)
            with self._cache() as cache:
                generated = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                                                max_new_tokens=max_new, pad_token_id=self.tokenizer.pad_token_id,
                                                stop_strings=until or None, tokenizer=self.tokenizer, **sampling)
            text = self.tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)


if __name__ == "__main__":  # python -m eval.lm_eval_model ARGS: lm-eval's own command line, with retrokv registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
