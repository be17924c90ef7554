"""What the HTTP routes share: the engine client, the config, metrics, the coordinator."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.messages import SetTenantBudgets
from kvserve.kv.tenant_ledger import Budget
from kvserve.sampling import SamplingParams
from kvserve.server.config import ServerConfig
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.responses.store import ResponseStore
from kvserve.server.tools.parsers import parser_for_template
from kvserve.server.tools.spec import ToolPlan, plan_tools
from kvserve.tenants import TenantsConfig

DEFAULT_MODEL_ID = "kvserve-default"


def served_model_id(model: str, served_model_name: str | None) -> str:
    """The model id of the API: ``--served-model-name`` when given; ``kvserve-default``
    for the bundled model; otherwise the last component of the ``--model`` path (the
    directory's name, a GGUF file's name without ``.gguf``), so no filesystem path leaks
    into the API."""
    if served_model_name:
        return served_model_name
    from kvserve.default_model import DEFAULT_MODEL_DIR

    path = Path(model)
    try:
        if path.resolve() == DEFAULT_MODEL_DIR.resolve():
            return DEFAULT_MODEL_ID
    except OSError:
        pass
    name = path.name or model
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


class ServerState:
    """Shared by every route of one app; ``config`` changes only on a tenants reload."""

    def __init__(self, engine: AsyncLLM, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_name = served_model_id(engine.info.model, config.served_model_name)
        # the path as given still names the model (clients written against older versions)
        self.model_aliases = {self.model_name, engine.info.model}
        self.metrics = ServerMetrics(engine, self.model_name)
        self.responses = ResponseStore(
            engine, config.responses_ttl, config.responses_max_per_tenant, self.model_name
        )
        self.metrics.registry.register(self.responses.collector)
        self.draining = False
        self.created = int(time.time())
        self.max_model_len = engine.info.max_model_len
        self.tokenizer = engine.tokenizer
        # how tool_choice auto reads calls (parsers keep no state: one serves every request)
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        self.tool_parser = parser_for_template(config.tool_call_parser, template)
        self.kv_events = None  # the KVEventPublisher, when this worker publishes
        self.coord = None  # the cluster coordinator, for session owner look-ups
        if engine.info.cluster is not None:
            from kvserve.ha.coordination import Coordinator

            self.coord = Coordinator.from_url(engine.info.cluster)

    def budgets(self, tenants: TenantsConfig) -> dict[str, Budget]:
        info = self.engine.info
        return tenants.budgets(info.num_blocks, info.block_size, info.bytes_per_block)

    async def reload_tenants(self) -> TenantsConfig:
        """Re-read the tenants file and apply it: API keys at once, budgets on the engine
        thread between steps (running requests keep their blocks). Raises ValueError, changing
        nothing, when the file is invalid or there is none."""
        current = self.config.tenants
        if current is None:
            raise ValueError("the server runs without a tenants file (--tenants)")
        new = TenantsConfig.load(current.source)
        await self.engine.call(SetTenantBudgets(self.budgets(new)))
        self.config = dataclasses.replace(self.config, tenants=new)
        return new

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A completions prompt as text (``echo``): as given, or its ids decoded ("" when
        the model has no tokenizer)."""
        if isinstance(prompt, str):
            return prompt
        tok = self.tokenizer
        return "" if tok is None else tok.decode(prompt, skip_special_tokens=False)

    def chat_prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt token ids of a chat request (the same for its first run and for a
        resume elsewhere: a failover must see exactly the primary's prompt). Raises
        ValueError without a tokenizer or chat template."""
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer, so chat is unavailable")
        return body.prompt_ids(self.tokenizer)

    def chat_params(self, body: ChatCompletionRequest) -> tuple[SamplingParams, ToolPlan]:
        """A chat request's sampling parameters and tool plan (the same for its first run
        and a resume elsewhere). Raises ValueError naming the field."""
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser)
        specials = plan.parser is not None and plan.parser.keeps_special_tokens
        return body.sampling_params(plan.structured, False if specials else None), plan
