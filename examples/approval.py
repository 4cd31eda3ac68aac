"""An expense that waits for a human: child runs, a durable wait for a signal, and a durable sleep.

    durably run examples/approval.py --workflow expense --input '{"amount": 420}' --key exp-1
        # drafts the report and parks, waiting for the signal "approval" (Ctrl-C or kill it any time)
    durably signal exp-1 approval '{"ok": true, "by": "ana"}'
        # from any shell; the waiting process continues at once, a stopped one when run again
    durably inspect exp-1

No live process is needed for the signal to count: it waits in the run's inbox until the
run reads it. `--no-wait` makes the first command exit (code 3) instead of waiting.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from durably_py import run, workflow


@dataclass
class Approval:
    ok: bool
    by: str


def check_policy(line: dict[str, Any]) -> dict[str, Any]:
    """Pretend to check one line of the report against the expense policy."""
    return {**line, "allowed": line["amount"] <= 300}


@workflow
async def check_line(ctx: Any, line: dict[str, Any]) -> dict[str, Any]:
    """One line of the report, checked in its own child run."""
    return await ctx.step(check_policy, line, name="check policy")


def pay_out(amount: float, approver: str) -> str:
    """Pretend to trigger the payment."""
    return f"paid {amount:.2f}, approved by {approver}"


@workflow
async def expense(ctx: Any, request: dict[str, Any]) -> str:
    """Split the expense into lines, check each in a child run, then wait for a human decision."""
    amount = float(request["amount"])
    lines = [{"n": i, "amount": round(amount / 2, 2)} for i in range(2)]
    checked = await ctx.join_all(await ctx.spawn_all([(check_line, line) for line in lines]))
    flagged = [r.value["n"] for r in checked if r.ok and not r.value["allowed"]]
    ctx.log(f"report drafted ({len(flagged)} flagged line(s)); waiting for the signal 'approval'")
    decision = await ctx.wait_for("approval", Approval, timeout=7 * 24 * 3600)
    if not decision.ok:
        return f"rejected by {decision.by}"
    await ctx.sleep(1)  # a durable pause before paying (a real one might wait for a payout window)
    return await ctx.step(pay_out, amount, decision.by, name="pay out")


if __name__ == "__main__":
    print(run(expense, {"amount": float(sys.argv[1]) if len(sys.argv) > 1 else 420}, key="expense-demo"))
