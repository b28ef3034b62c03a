"""Losses and schedules against plain references."""

import math

import pytest
import torch

from models.gates.dms import capacity_loss as dms_capacity_loss
from models.gates.dms import head_cap_loss as dms_head_cap_loss
from models.gates.trimkv import capacity_loss as trimkv_capacity_loss
from models.metrics import token_kl
from train.config import ScheduleConfig
from train.losses import chunked_distillation
from train.schedule import schedule_at


def reference_kl(student_logits, teacher_logits, direction, temperature):
    out = []
    for s_row, t_row in zip(student_logits.double(), teacher_logits.double()):
        ps = torch.softmax(s_row / temperature, 0)
        pt = torch.softmax(t_row / temperature, 0)
        p, q = (pt, ps) if direction == "forward" else (ps, pt)
        out.append(float(sum(p[i] * math.log(p[i] / q[i]) for i in range(len(p)))) * temperature**2)
    return torch.tensor(out)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_token_kl_matches_reference(direction, temperature):
    torch.manual_seed(0)
    s, t = torch.randn(5, 11), torch.randn(5, 11)
    torch.testing.assert_close(token_kl(s, t, direction, temperature).double(), reference_kl(s, t, direction, temperature).double(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(token_kl(s, t, "forward", 1.0), token_kl(s, t, "reverse", 1.0))


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_chunked_distillation_equals_unchunked_and_has_gradients(direction):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False)
    student = torch.randn(2, 9, 8, requires_grad=True)
    teacher = torch.randn(2, 9, 8)
    ids = torch.randint(0, 13, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    kl_small, nll_small = chunked_distillation(head, student, teacher, mask, ids, direction, 1.5, chunk_tokens=4)
    kl_big, nll_big = chunked_distillation(head, student, teacher, mask, ids, direction, 1.5, chunk_tokens=1000)
    keep = mask.bool()
    expected = reference_kl(head(student[keep]).detach(), head(teacher[keep]).detach(), direction, 1.5).mean()
    torch.testing.assert_close(kl_small.double(), expected.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl_small, kl_big)
    both = keep[:, :-1] & keep[:, 1:]  # a trained position whose next token is real
    nll_ref = torch.nn.functional.cross_entropy(head(student[:, :-1][both]), ids[:, 1:][both])
    torch.testing.assert_close(nll_small, nll_ref, atol=1e-5, rtol=1e-5)
    (kl_small + nll_small).backward()
    grad_chunked = student.grad.clone()
    assert grad_chunked[0, :3].abs().sum() == 0 and grad_chunked[1].abs().sum() > 0


def test_a_separate_teacher_scores_with_its_own_head():
    """A full fine-tune trains the student's LM head; the teacher's logits come from the teacher's head."""
    torch.manual_seed(0)
    head, teacher_head = torch.nn.Linear(8, 13, bias=False), torch.nn.Linear(8, 13, bias=False)
    student, teacher = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    ids, mask = torch.randint(0, 13, (1, 6)), torch.ones(1, 6, dtype=torch.long)
    kl, _ = chunked_distillation(head, student, teacher, mask, ids, "reverse", 1.0, teacher_head=teacher_head)
    expected = reference_kl(head(student[0]).detach(), teacher_head(teacher[0]).detach(), "reverse", 1.0).mean()
    torch.testing.assert_close(kl.double(), expected.double(), atol=1e-5, rtol=1e-5)
    shared, _ = chunked_distillation(head, student, teacher, mask, ids, "reverse", 1.0)
    assert not torch.allclose(kl, shared)


def test_dms_capacity_loss_is_one_sided_and_masks_padding():
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    decisions = torch.zeros(2, 1, 5)
    decisions[0, 0, 1:4] = 1  # all valid keys of sequence 0 evicted (keys 1..3; key 4 has no decider)
    loss, achieved = dms_capacity_loss([decisions, decisions], mask, target=0.5)
    # sequence 0: fraction 1.0 -> no loss; sequence 1: fraction 0 -> 0.5
    assert math.isclose(float(loss), 0.25, abs_tol=1e-6)
    assert math.isclose(float(achieved), 0.5, abs_tol=1e-6)


def test_trimkv_capacity_loss_reference():
    occ = torch.tensor([[[1.0, 3.0, 5.0]]])  # [B, Hkv, T]
    mask = torch.tensor([[1, 1, 1]])
    loss = trimkv_capacity_loss([occ], mask, budget=2.0)
    expected = (0 / 1 + 1 / 2 + 3 / 3) / 3
    assert math.isclose(float(loss), expected, abs_tol=1e-6)


def test_cr_schedule_is_linear_in_cr_after_the_neuron_warmup():
    cfg = ScheduleConfig(cr_final=8, steps_per_cr=100, neuron_warmup_steps=50, tau_final=0.05)
    assert schedule_at(0, cfg, 0.1).neuron_keep == 1.0 and schedule_at(25, cfg, 0.1).neuron_keep == 0.5
    assert schedule_at(49, cfg, 0.1).cr == 1.0
    assert schedule_at(150, cfg, 0.1).cr == pytest.approx(2.0)
    assert schedule_at(750, cfg, 0.1).cr == pytest.approx(8.0)
    assert schedule_at(5000, cfg, 0.1).cr == pytest.approx(8.0)
    assert schedule_at(750, cfg, 0.1).tau == pytest.approx(0.05)
    assert schedule_at(150, cfg, 0.1).eviction_target == pytest.approx(0.5)


def test_head_cap_penalises_only_heads_above_the_cap():
    mask = torch.ones(1, 9, dtype=torch.long)  # 8 keys carry a decision (the last has none yet)
    everything = torch.ones(1, 2, 9)
    half = torch.zeros(1, 2, 9)
    half[..., :4] = 1
    loss = dms_head_cap_loss([everything, half], mask, cap=0.9)  # 2 layers x 2 heads: 1.0, 1.0, 0.5, 0.5
    assert float(loss) == pytest.approx((0.1 + 0.1 + 0 + 0) / 4)
    assert float(dms_head_cap_loss([half], mask, cap=0.9)) == 0.0
