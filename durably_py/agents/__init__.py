"""Integrations that make agent frameworks' runs durable inside a durably workflow.

`durably_py.agents.pydantic_ai` (extra `durably-py[pydantic-ai]`): each model request and each tool call of a
Pydantic AI agent is a durable step ([docs/agents.md](../docs/agents.md)).
"""
