"""The fair queue's order, as a specification: least weighted service first (prompt tokens at
release, output tokens weighing more), no credit banked while idle, strict priority classes,
FCFS within a tenant; and the round-robin and FCFS baselines."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.gateway.admission.fair_queue import FairQueue
from services.gateway.admission.tenants import Tenant

A, B, C = Tenant("a"), Tenant("b"), Tenant("c")


@dataclass(eq=False)
class Req:
    tenant: Tenant
    prompt_tokens: int = 10
    name: str = ""
    seq: int = 0
    slots: int = 1
    max_output_tokens: int = 10
    share: str = ""

    def __post_init__(self) -> None:
        self.share = self.share or self.tenant.name


def drain(queue: FairQueue, count: int | None = None, output_tokens: int = 0) -> list[str]:
    served = []
    while len(queue) and (count is None or len(served) < count):
        entry = queue.peek()
        queue.pop(entry)
        if output_tokens:
            queue.charge_output(entry, output_tokens)
        served.append(entry.name or entry.tenant.name)
    return served


def test_vtc_serves_the_tenant_with_least_service_and_fcfs_within_a_tenant():
    queue = FairQueue("vtc")
    for i in range(4):
        queue.push(Req(A, name=f"a{i}"))
    for i in range(2):
        queue.push(Req(B, name=f"b{i}"))
    # A came first, then the two alternate; each tenant's own requests stay in order.
    assert drain(queue) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_vtc_charges_prompt_tokens_so_long_prompts_get_fewer_turns():
    queue = FairQueue("vtc")
    for _ in range(6):
        queue.push(Req(A, prompt_tokens=100))
        queue.push(Req(B, prompt_tokens=25))
    served = drain(queue, count=5)
    assert served.count("b") == 4 and served.count("a") == 1


def test_output_tokens_weigh_more_than_prompt_tokens():
    queue = FairQueue("vtc", output_weight=2.0)
    for _ in range(2):
        queue.push(Req(A, prompt_tokens=10))
        queue.push(Req(B, prompt_tokens=10))
    drain(queue, count=2)  # one each; both still backlogged
    queue.charge_output(Req(A), 5)  # A: 10 + 2*5 = 20
    queue.charge_output(Req(B), 9)  # B: 10 + 2*9 = 28
    assert queue.counters == {"a": 20.0, "b": 28.0}
    assert queue.peek().tenant is A


def test_weights_divide_the_counter():
    heavy, light = Tenant("heavy", weight=2.0), Tenant("light", weight=1.0)
    queue = FairQueue("vtc")
    for _ in range(30):
        queue.push(Req(heavy))
        queue.push(Req(light))
    served = drain(queue, count=30)
    assert served.count("heavy") == 20 and served.count("light") == 10


def test_an_idle_tenant_banks_no_credit():
    queue = FairQueue("vtc")
    for _ in range(20):
        queue.push(Req(A))
    drain(queue, count=10)  # A alone for a while: its counter is 100, B's still 0
    queue.push(Req(B, name="b0"))
    queue.push(Req(B, name="b1"))
    # B is lifted to A's counter on arrival: the two alternate instead of B taking 10 in a row.
    assert queue.counters["b"] == queue.counters["a"]
    assert drain(queue, count=4).count("a") == 2


def test_a_tenant_returning_to_an_empty_queue_starts_from_the_last_served():
    queue = FairQueue("vtc")
    queue.push(Req(A, prompt_tokens=50))
    drain(queue)
    queue.push(Req(B))
    assert queue.counters["b"] == 0.0  # the counter of A when it was served: 0
    drain(queue)
    queue.push(Req(C))
    assert queue.counters["c"] == 0.0  # B's counter when served was 0 as well
    queue.push(Req(A))
    assert queue.counters["a"] == 50.0  # never lowered


def test_higher_priority_classes_go_first_whatever_their_service():
    gold, free = Tenant("gold", priority=1), Tenant("free", priority=0)
    queue = FairQueue("vtc")
    queue.push(Req(free, name="f0"))
    queue.counters["gold"] = 1e9
    queue.push(Req(gold, name="g0"))
    queue.push(Req(gold, name="g1"))
    assert drain(queue) == ["g0", "g1", "f0"]


def test_round_robin_takes_one_request_per_tenant_in_turn():
    queue = FairQueue("round_robin")
    for i in range(3):
        queue.push(Req(A, prompt_tokens=1000, name=f"a{i}"))
    for i in range(3):
        queue.push(Req(B, prompt_tokens=1, name=f"b{i}"))
    assert drain(queue) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_fcfs_ignores_tenants_and_priorities():
    queue = FairQueue("fcfs")
    queue.push(Req(A, name="a0"))
    queue.push(Req(A, name="a1"))
    queue.push(Req(Tenant("gold", priority=5), name="g0"))
    assert drain(queue) == ["a0", "a1", "g0"]


def test_remove_takes_a_waiting_request_out():
    queue = FairQueue("vtc")
    first, second = Req(A, name="a0"), Req(A, name="a1")
    queue.push(first)
    queue.push(second)
    assert queue.remove(first) and not queue.remove(first)
    assert queue.queued("a") == 1 and queue.tokens == 10
    assert drain(queue) == ["a1"]
    assert queue.heads() == [] and len(queue) == 0


@pytest.mark.parametrize("policy", ["vtc", "round_robin", "fcfs"])
def test_ahead_counts_only_what_the_policy_serves_first(policy):
    queue = FairQueue(policy)
    for _ in range(10):
        queue.push(Req(A, prompt_tokens=100))
    requests, tokens = queue.ahead(Req(B))
    if policy == "fcfs":
        assert (requests, tokens) == (10, 1000)
    else:  # a newcomer waits behind at most one of A's requests, not A's whole backlog
        assert requests <= 1 and tokens <= 100
    assert queue.ahead(Req(A)) == (10, 1000)  # A waits behind its own backlog


def test_weighted_shares_hold_under_continuous_backlog():
    """Both tenants always backlogged, requests of equal shape: served tokens split by weight."""
    heavy, light = Tenant("heavy", weight=2.0), Tenant("light", weight=1.0)
    queue = FairQueue("vtc")
    served = {"heavy": 0, "light": 0}
    for _ in range(5):
        queue.push(Req(heavy, prompt_tokens=20))
        queue.push(Req(light, prompt_tokens=20))
    for _ in range(600):
        entry = queue.peek()
        queue.pop(entry)
        queue.charge_output(entry, 16)
        served[entry.tenant.name] += 20 + 16
        queue.push(Req(entry.tenant, prompt_tokens=20))  # a closed loop keeps both waiting
    assert served["heavy"] / served["light"] == pytest.approx(2.0, rel=0.02)
