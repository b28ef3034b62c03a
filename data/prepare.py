"""Render rows as text (chat template where there is a prompt), tokenise, and pack or pad to max_length."""

from __future__ import annotations

import logging

import datasets

from data.sources import DataError, parallel

log = logging.getLogger(__name__)


def render(ds: datasets.Dataset, tokenizer, chat_template: bool, num_proc: int = 1) -> datasets.Dataset:
    """Rows -> {text, prompt_text}; prompt_text is the prefix a prompt mask may exclude from the loss."""
    if "prompt" not in ds.column_names:
        return ds.map(lambda r: {"text": r["text"], "prompt_text": ""}, remove_columns=ds.column_names, desc="render")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"data.chat_template=true but tokenizer {tokenizer.name_or_path!r} has no chat template; "
                        "set data.chat_template=false to join prompt and completion as plain text")

    def one(row):
        if not chat_template:
            prompt = row["prompt"].rstrip() + "\n"
            return {"text": prompt + row["completion"], "prompt_text": prompt}
        user = [{"role": "user", "content": row["prompt"]}]
        # enable_thinking reaches templates that have a reasoning mode (Qwen3); the others ignore it
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=True)
        text = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": row["completion"]}],
                                             tokenize=False, enable_thinking=True)
        return {"text": text, "prompt_text": prompt if text.startswith(prompt) else ""}

    return ds.map(one, remove_columns=ds.column_names, desc="chat template", num_proc=parallel(ds, num_proc))


def tokenize(ds: datasets.Dataset, tokenizer, mask_prompt: bool, num_proc: int = 1) -> datasets.Dataset:
    def batch(rows):
        ids = tokenizer(rows["text"], add_special_tokens=False)["input_ids"]
        prompts = tokenizer(rows["prompt_text"], add_special_tokens=False)["input_ids"] if mask_prompt else None
        loss = []
        for i, seq in enumerate(ids):
            # loss_mask[t] = 1: the distribution at t (predicting t + 1) is trained; with a prompt mask
            # that starts at the prompt's last token, which predicts the first completion token
            skip = max(len(prompts[i]) - 1, 0) if prompts is not None else 0
            loss.append([0] * min(skip, len(seq)) + [1] * max(len(seq) - skip, 0))
        return {"input_ids": ids, "loss_mask": loss}

    return ds.map(batch, batched=True, remove_columns=ds.column_names, desc="tokenize", num_proc=parallel(ds, num_proc))


def pack_documents(ds: datasets.Dataset, max_length: int, eos_id: int, pad_id: int) -> list[dict]:
    """Whole documents (each followed by EOS) joined into rows, every row starting at a document start.

    A document that does not fit in what is left of a row starts the next row; the rest of the row is
    padding (attention and loss masked). Documents are already at most max_length - 1 tokens.
    """
    rows, ids, loss = [], [], []
    for row in ds:
        doc = row["input_ids"] + [eos_id]
        if ids and len(ids) + len(doc) > max_length:
            rows.append(padded_row(ids, loss, max_length, pad_id))
            ids, loss = [], []
        ids, loss = ids + doc, loss + row["loss_mask"] + [1]
    if ids:
        rows.append(padded_row(ids, loss, max_length, pad_id))
    return rows


def padded_row(ids: list[int], loss: list[int], max_length: int, pad_id: int) -> dict:
    """Real tokens then padding up to max_length; padding is out of attention and the loss."""
    pad = max_length - len(ids)
    return {"input_ids": ids + [pad_id] * pad, "loss_mask": loss + [0] * pad, "attention_mask": [1] * len(ids) + [0] * pad}


def pack_or_pad(ds: datasets.Dataset, max_length: int, packing: bool, too_long: str, eos_id: int, pad_id: int,
                split: str = "train"):
    """Returns (dataset of fixed-length rows, counts). Packing joins whole documents, EOS after each, and
    starts every row at a document start (see pack_documents)."""
    lengths = ds["input_ids"]
    limit = max_length - 1 if packing else max_length  # room for the separating EOS when packing
    over = sum(len(x) > limit for x in lengths)
    if too_long == "drop":
        ds = ds.filter(lambda r: len(r["input_ids"]) <= limit, desc="drop too long")
    else:
        ds = ds.map(lambda r: {k: r[k][:limit] for k in ("input_ids", "loss_mask")}, desc="truncate")
    counts = {"too_long": over, "dropped": over if too_long == "drop" else 0, "truncated": over if too_long == "truncate" else 0}
    if len(ds) == 0:
        raise DataError(f"no rows are left in the {split} split after data.too_long={too_long!r} with data.max_length="
                        f"{max_length}; raise data.max_length or use data.too_long=truncate")
    if packing:
        rows = pack_documents(ds, max_length, eos_id, pad_id)
        counts["padding"] = sum(max_length - sum(r["attention_mask"]) for r in rows)
    else:
        rows = [padded_row(row["input_ids"], row["loss_mask"], max_length, pad_id) for row in ds]
    counts["tokens"] = sum(sum(r["attention_mask"]) for r in rows)
    counts["sequences"] = len(rows)
    return datasets.Dataset.from_list(rows), counts


def prepare(raw: datasets.Dataset, tokenizer, cfg, name: str) -> datasets.Dataset:
    """raw rows -> fixed-length token rows, with a one-line summary of what was kept."""
    rows_in = len(raw)
    if rows_in == 0:
        raise DataError(f"the {name} split of data.source={cfg.source!r} has no rows (after filtering)")
    rendered = render(raw, tokenizer, cfg.chat_template, cfg.num_proc)
    tokens = tokenize(rendered, tokenizer, cfg.mask_prompt, cfg.num_proc)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    packed, counts = pack_or_pad(tokens, cfg.max_length, cfg.packing, cfg.too_long, eos, pad, name)
    log.info("data %s: rows in %d, rows kept %d (too long %d: %s), tokens %d, %s sequences %d (padding %d)", name,
             rows_in, rows_in - counts["dropped"], counts["too_long"], cfg.too_long, counts["tokens"],
             "packed" if cfg.packing else "padded", counts["sequences"], counts.get("padding", 0))
    packed.info.description = str({"rows_in": rows_in, **counts})
    return packed
