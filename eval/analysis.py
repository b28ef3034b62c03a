"""Pareto frontiers and the DMS paper's integrated improvement of one method over another.

Points are (cost, score): lower cost is better; higher score is better unless `higher_is_better` is False
(perplexity). A frontier is the points that no other point beats on both axes, sorted by cost. The
improvement of A over B is the mean, over the cost interval both frontiers cover, of A's score minus B's
(each frontier linearly interpolated between its points; the sign is flipped for lower-is-better scores, so
a positive value always means A is better).
"""

from __future__ import annotations

from itertools import pairwise


def pareto_frontier(points: list[tuple[float, float]], higher_is_better: bool = True) -> list[tuple[float, float]]:
    sign = 1.0 if higher_is_better else -1.0
    front: list[tuple[float, float]] = []
    for cost, score in sorted(points, key=lambda p: (p[0], -sign * p[1])):
        if not front or sign * score > sign * front[-1][1]:
            if front and front[-1][0] == cost:
                front[-1] = (cost, score)
            else:
                front.append((cost, score))
    return front


def interpolate(front: list[tuple[float, float]], x: float) -> float:
    """The frontier's score at cost x (linear between points; x must lie within the frontier's costs)."""
    for (x0, y0), (x1, y1) in pairwise(front):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if front and x == front[0][0]:
        return front[0][1]
    raise ValueError(f"cost {x} lies outside the frontier's interval [{front[0][0]}, {front[-1][0]}]")


def integrated_improvement(front_a: list[tuple[float, float]], front_b: list[tuple[float, float]],
                           higher_is_better: bool = True) -> float | None:
    """Mean of A - B over the shared cost interval (None when the frontiers share no interval of length > 0)."""
    if not front_a or not front_b:
        return None
    low = max(front_a[0][0], front_b[0][0])
    high = min(front_a[-1][0], front_b[-1][0])
    if high <= low:
        return None
    xs = sorted({low, high, *(x for x, _ in front_a + front_b if low < x < high)})
    # the difference is linear between consecutive breakpoints, so the trapezoid rule is exact
    diff = [interpolate(front_a, x) - interpolate(front_b, x) for x in xs]
    area = sum((x1 - x0) * (d0 + d1) / 2 for (x0, x1), (d0, d1) in zip(pairwise(xs), pairwise(diff)))
    return (area / (high - low)) * (1.0 if higher_is_better else -1.0)


def improvement_at(point: tuple[float, float], front_b: list[tuple[float, float]],
                   higher_is_better: bool = True) -> float | None:
    """A single point's score minus B's frontier at the same cost; the comparison for a learned method
    measured at one operating point only. Past B's costliest point B keeps its best score (with a larger
    budget B can still do what it did with less); below B's cheapest point there is no comparison (None)."""
    if not front_b or point[0] < front_b[0][0]:
        return None
    b = front_b[-1][1] if point[0] >= front_b[-1][0] else interpolate(front_b, point[0])
    return (point[1] - b) * (1.0 if higher_is_better else -1.0)
