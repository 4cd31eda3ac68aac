"""Quickstart: a small durable checkout pipeline with a fan-out and a retried flaky call.

    python examples/quickstart.py            # 5 orders
    python examples/quickstart.py 8          # 8 orders
    durably run examples/quickstart.py -- 8  # the same, with a live progress view
    durably run examples/quickstart.py --workflow checkout --input '{"orders": 3}'
    durably list                             # the runs it recorded
    durably inspect RUN_ID                   # the tree of its steps

Every `ctx.step` result is recorded under `.durably/`; if the process dies half way,
running the same command again answers the finished steps from the log and carries on.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from durably_py import Retry, attempt, is_ok, run, workflow


def load_orders(count: int) -> list[dict[str, Any]]:
    """Pretend to read orders from a database."""
    time.sleep(0.05)
    return [{"id": f"order-{i}", "items": i % 3 + 1, "unit_price": 4.5 + i} for i in range(count)]


def price_order(order: dict[str, Any]) -> dict[str, Any]:
    """Pretend to call a pricing service for one order."""
    time.sleep(0.1)
    subtotal = order["items"] * order["unit_price"]
    return {"id": order["id"], "total": round(subtotal * 1.2, 2)}


def charge_card(total: float) -> dict[str, Any]:
    """A payment call that fails on its first attempt, the way real networks do."""
    time.sleep(0.05)
    current = attempt()
    if current.number == 1:
        raise ConnectionError("payment gateway timed out")
    return {"charged": total, "payment_id": f"pay-{current.operation_id.rsplit('/', 1)[-1]}"}


def send_receipt(payment: dict[str, Any]) -> str:
    """Pretend to email a receipt."""
    time.sleep(0.05)
    return f"receipt for {payment['payment_id']} ({payment['charged']:.2f})"


@workflow
async def checkout(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    """Load orders, price them in parallel, charge the sum (retrying), send a receipt."""
    orders = await ctx.step(load_orders, input["orders"])
    ctx.log(f"loaded {len(orders)} orders")
    priced = await ctx.parallel([ctx.step(price_order, order, name="price_order") for order in orders],
                                concurrency=4)
    totals = [result.value for result in priced if is_ok(result)]
    total = round(sum(t["total"] for t in totals), 2)
    ctx.log(f"priced {len(totals)} orders, total {total:.2f}")
    payment = await ctx.step(charge_card, total, retry=Retry(3, backoff="exponential", base=0.1))
    receipt = await ctx.step(send_receipt, payment)
    return {"orders": len(orders), "total": total, "payment": payment["payment_id"], "receipt": receipt}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the checkout for `argv[0]` orders (default 5) and print its result."""
    args = sys.argv[1:] if argv is None else argv
    count = int(args[0]) if args else 5
    result = run(checkout, {"orders": count})
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
