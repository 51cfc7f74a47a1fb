"""A ``verifiers`` environment as a task (``env=verifiers``): the tasks of a taskset package written for
prime-rl's ``verifiers`` (its v1 API: a ``vf.Taskset`` exported in ``__all__``, loaded by ``env.id`` as
``vf.load_taskset`` does) become the rows, and each task's own scoring (its ``@vf.reward`` methods, plugged
rewards and judges, with their weights) is the reward, every component logged apart; its ``@vf.metric`` s are
logged too, as components of weight 0.

The rollout is ours (vLLM, token in / token out); only the scoring and the tools are the taskset's. Each
completion becomes a ``vf.Trace`` of the episode's messages, which the task scores as verifiers' own harnesses
would have it. Where the task has tool servers (``Task.toolsets``) and ``env.max_steps > 1``, the system prompt
lists their tools and :class:`torchrl_grpo.episodes.verifiers_turns.VerifiersTools` runs the calls the model
writes (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) through each toolset's MCP server, in this
process, named as verifiers names them (``<server>_<tool>``).

Refused in one line when the task is built: tasks that need a container or a sandbox runtime to score, and
toolsets that keep state between calls (verifiers syncs that state over a channel of its rollout server).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets

from torchrl_grpo.core.background_loop import BackgroundLoop
from torchrl_grpo.core.errors import ConfigError, one_line
from torchrl_grpo.tasks.base import Reward, Task
from torchrl_grpo.tasks.registry import register_task, setting

INSTALL = ('pip install -e ".[verifiers]" (on the CPU stack: beside vLLM 0.33 pip finds no versions for both, '
           "see docs/installation.md)")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _needs_runtime(fn) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def tool_calls(text: str) -> list[str]:
    """The bodies of the ``<tool_call>...</tool_call>`` blocks in a turn, in order."""
    return _TOOL_CALL.findall(text)


def parse_call(body: str) -> tuple[str, Any]:
    """The tool's name and the arguments (an object, or the string the model wrote) of one call's body;
    ValueError where it is not a JSON object with a name."""
    call = json.loads(body)
    if not isinstance(call, dict) or "name" not in call:
        raise ValueError("no \"name\" in it")
    return call["name"], call.get("arguments") or {}


@dataclass(frozen=True)
class ToolResult:
    content: str
    error: bool


class Toolbox:
    """One verifiers task's tool servers, set up for that task: MCP servers in this process, their tools named as
    verifiers advertises them to a model."""

    def __init__(self, servers: dict[str, Any], dispatch: dict[str, tuple[str, str]], schemas: list[dict]):
        self.servers, self.dispatch, self.schemas = servers, dispatch, schemas

    @classmethod
    async def open(cls, task) -> Toolbox:
        from mcp.server.mcpserver import MCPServer

        servers, dispatch, schemas = {}, {}, []
        for toolset in type(task).toolsets(task.config):
            server = MCPServer(name=toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            await toolset.setup()
            await toolset.setup_task(task)
            servers[toolset.server_name] = server
            for tool in await server.list_tools():
                full = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
                if full in dispatch:
                    raise ConfigError(f"verifiers task {type(task).__name__}: two tools are named {full!r}")
                dispatch[full] = (toolset.server_name, tool.name)
                schemas.append({"name": full, "description": tool.description or "",
                                "parameters": tool.input_schema})
        return cls(servers, dispatch, schemas)

    async def call(self, body: str) -> ToolResult:
        """Run one call the model wrote (the JSON inside its ``<tool_call>``); a call that cannot run is an error
        message to the model, never a failed run."""
        try:
            name, arguments = parse_call(body)
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
        except ValueError as err:
            return ToolResult(f"error: the tool call is not JSON with a name and arguments ({one_line(err)})", True)
        if name not in self.dispatch:
            return ToolResult(f"error: no tool named {name!r}; the tools are {', '.join(self.dispatch)}", True)
        server, raw = self.dispatch[name]
        try:
            result = await self.servers[server].call_tool(raw, arguments)
        except Exception as err:  # the tool's own failure, told to the model
            return ToolResult(f"error: {one_line(err)}", True)
        text = "\n".join(getattr(block, "text", None) or str(block) for block in result.content)
        return ToolResult(text, bool(getattr(result, "is_error", False)))


class VerifiersEnv:
    """A loaded taskset's tasks, scored and served from any thread: verifiers' coroutines run on one event loop
    of their own."""

    def __init__(self, tasks: list, timeout_s: float):
        self.tasks, self.timeout_s = tasks, timeout_s
        self.loop = BackgroundLoop("verifiers")
        self.lock = threading.Lock()
        self.toolboxes: dict[int, Any] = {}  # task index -> future of its Toolbox
        self.scores: dict[tuple, list] = {}  # (task index, conversation) -> [future of its scores, reads left]
        self.prompts: list[list[dict]] = []  # each task's messages, system prompt first

    def toolbox(self, index: int) -> Toolbox:
        with self.lock:
            if index not in self.toolboxes:
                self.toolboxes[index] = self.loop.submit(Toolbox.open(self.tasks[index]), self.timeout_s)
            future = self.toolboxes[index]
        return future.result()

    def call_tools(self, index: int, text: str) -> list[ToolResult]:
        """The results of the tool calls in ``text``, in order (none: the turn is the episode's answer)."""
        bodies = tool_calls(text)
        if not bodies:
            return []
        try:
            box = self.toolbox(index)
            return [self.loop.run(box.call(body), self.timeout_s) for body in bodies]
        except TimeoutError:
            return [ToolResult(f"error: the tool call timed out after {self.timeout_s:g} s", True)]
        except Exception as err:  # the task's tool servers did not start: the model hears it, the count shows it
            return [ToolResult(f"error: the tools are not available ({one_line(err)})", True)]

    def trace(self, index: int, conversation: Sequence[Mapping[str, Any]]):
        """The episode as a ``vf.Trace``: the assistant turns' tool calls parsed, each tool message answering them
        in order."""
        import verifiers.v1 as vf
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        task, messages, pending = self.tasks[index], [], []
        for turn, message in enumerate(conversation):
            role, content = message["role"], str(message["content"])
            if role == "assistant":
                calls = [_trace_call(f"call_{turn}_{k}", body) for k, body in enumerate(tool_calls(content))]
                pending = [call.id for call in calls]
                messages.append(vf.AssistantMessage(content=content, tool_calls=calls or None))
            elif role == "tool":
                messages.append(vf.ToolMessage(tool_call_id=pending.pop(0) if pending else "call_unknown",
                                               content=content))
            elif role == "system":
                messages.append(vf.SystemMessage(content=content))
            else:
                messages.append(vf.UserMessage(content=content))
        nodes = [MessageNode(message=m, parent=i - 1 if i else None, sampled=m.role == "assistant")
                 for i, m in enumerate(messages)]
        return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key),
                     agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True)

    async def _score(self, index: int, conversation: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        trace = self.trace(index, conversation)
        await self.tasks[index].score(trace)
        values = {name: (math.nan if r is None else r.score) for name, r in trace.rewards.items()}
        values.update({name: (math.nan if v is None else float(v)) for name, v in trace.metrics.items()})
        return values

    async def component(self, name: str, readers: int, index: int, conversation: list[dict]) -> float:
        """Component ``name`` of the episode's scores: the first of its ``readers`` to ask scores the trace (once,
        on the verifiers loop), the last one forgets it."""
        key = (index, json.dumps(conversation))
        with self.lock:
            slot = self.scores.setdefault(key, [None, readers])
            if slot[0] is None:
                slot[0] = self.loop.submit(self._score(index, conversation), self.timeout_s)
            slot[1] -= 1
            if slot[1] == 0:
                del self.scores[key]
        try:
            values = await asyncio.wrap_future(slot[0])
        except TimeoutError:
            raise TimeoutError(f"the task's scoring timed out after {self.timeout_s:g} s (env.timeout_s)") from None
        if name not in values:
            raise ValueError(f"the task's scoring recorded no {name!r} (it has {', '.join(values) or 'none'}); a "
                             "reward that returns several values (a mapping) is not supported")
        return values[name]


def _trace_call(call_id: str, body: str):
    """One call as the trace holds it; one that does not parse keeps its body as the arguments, unnamed."""
    import verifiers.v1 as vf

    try:
        name, arguments = parse_call(body)
    except ValueError:
        name, arguments = "", body
    return vf.ToolCall(id=call_id, name=str(name), arguments=arguments if isinstance(arguments, str)
                       else json.dumps(arguments))


@dataclass
class VerifiersTask(Task):
    """Rows are the taskset's tasks (``vf_index``); see the module's docstring."""

    env: VerifiersEnv | None = None

    def prompt_messages(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        return [dict(m) for m in self.env.prompts[int(row["vf_index"])]]


def _component_fn(env: VerifiersEnv, name: str, readers: int):
    async def component(completion: str, row: Mapping[str, Any]) -> float:
        """One of the verifiers task's rewards or metrics, read from its scoring of the episode (the turn
        environment's whole ``conversation``, else the prompt and this completion)."""
        index = int(row["vf_index"])
        conversation = row.get("conversation") or [*env.prompts[index], {"role": "assistant", "content": completion}]
        return await env.component(name, readers, index, list(conversation))
    component.__qualname__ = component.__name__ = name
    return component


def _load_tasks(taskset_id: str, taskset_args: Mapping[str, Any], size: int | None) -> list:
    from pydantic import ValidationError
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    try:
        config = taskset_config_type(taskset_id).model_validate({**taskset_args, "id": taskset_id})
    except ValidationError as err:
        wrong = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"env.taskset: {wrong} (the config of taskset {taskset_id})") from None
    except Exception as err:
        raise ConfigError(f"env.id={taskset_id}: loading its taskset failed ({one_line(err)}); install the "
                          "environment's package, or check env.id") from None
    try:
        taskset = load_taskset(config)
        tasks = []
        for task in taskset:  # a taskset may be infinite: read only what is used
            if size is not None and len(tasks) == size:
                break
            tasks.append(task)
    except Exception as err:
        raise ConfigError(f"env.id={taskset_id}: loading its tasks failed ({one_line(err)}); check env.taskset") \
            from None
    if not tasks:
        raise ConfigError(f"env.id={taskset_id}: the taskset yields no tasks; check env.taskset")
    return tasks


def _check_task(taskset_id: str, task) -> tuple[dict[str, float], list[str]]:
    """The task's rewards (name -> weight, by priority, then its judges) and metric names; ConfigError for what
    cannot run here."""
    import verifiers.v1 as vf

    name = type(task).__name__
    if task.NEEDS_CONTAINER:
        raise ConfigError(f"env.id={taskset_id}: its task {name} needs a container, which env=verifiers does not start")
    rewards, metrics, judges = task.hooks("reward"), task.hooks("metric"), task.plugged_judges()
    runtime = [fn.__name__ for fn in (*rewards, *metrics) if _needs_runtime(fn)]
    runtime += [judge.reward_name for judge in judges if _needs_runtime(judge.score)]
    if runtime:
        raise ConfigError(f"env.id={taskset_id}: {name}'s {', '.join(runtime)} need a sandbox runtime to score, "
                          "which env=verifiers does not start")
    for toolset in type(task).toolsets(task.config):
        if toolset._state_cls is not vf.State:
            raise ConfigError(f"env.id={taskset_id}: its toolset {type(toolset).__name__} keeps state between calls "
                              "(a custom State), which env=verifiers does not carry; use stateless tools")
    weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in rewards}
    weights.update({judge.reward_name: float(judge.config.weight) for judge in judges})
    if not weights:
        raise ConfigError(f"env.id={taskset_id}: its task {name} has no @vf.reward; nothing scores an episode")
    return weights, [fn.__name__ for fn in metrics]


def _tool_prompt(schemas: list[dict]) -> str:
    lines = ["You can call these tools. To call one, write <tool_call>{\"name\": \"<tool>\", \"arguments\": "
             "{...}}</tool_call>; its result comes back in a tool message. Answer without a tool call when you "
             "are done."]
    lines += [json.dumps(schema) for schema in schemas]
    return "\n".join(lines)


def _prompt(task, system_prompt: str | None, tools: str | None) -> list[dict]:
    from verifiers.v1.types import content_text

    data = task.data
    system = "\n\n".join(s for s in (system_prompt or data.system_prompt, tools) if s)
    prompt = data.prompt
    if isinstance(prompt, str):
        turns = [{"role": "user", "content": prompt}]
    else:
        turns = [{"role": m.role, "content": content_text(m.content)} for m in prompt or []]
    if system and turns and turns[0]["role"] == "system":
        turns[0] = {"role": "system", "content": f"{system}\n\n{turns[0]['content']}"}
    elif system:
        turns.insert(0, {"role": "system", "content": system})
    if not any(t["role"] == "user" for t in turns):
        raise ConfigError(f"verifiers task {task.data.idx}: its prompt has no user message (a task whose user "
                          "opens the conversation is not supported)")
    return turns


def _columns(tasks: list) -> dict[str, list]:
    """The rows: each task's index, prompt text and answer, and the scalar fields its data class adds."""
    from verifiers.v1.task import TaskData

    dumps = [task.data.model_dump(mode="json") for task in tasks]
    extra = [k for k, v in dumps[0].items() if k not in TaskData.model_fields and k not in ("question", "answer")
             and all(isinstance(d.get(k), type(v)) for d in dumps) and isinstance(v, (str, int, float, bool))]
    columns = {"vf_index": list(range(len(tasks))), "question": [task.data.prompt_text for task in tasks],
               "answer": [str(d.get("answer", "")) for d in dumps]}
    columns.update({k: [d[k] for d in dumps] for k in extra})
    return columns


@dataclass(frozen=True)
class VerifiersSettings:
    """The ``env`` keys of a verifiers environment."""

    id: str | None = setting(None, "the environment's taskset package, e.g. my_env")
    taskset: dict | None = setting(None, "its taskset config's fields; null = its defaults")
    size: int | None = setting(None, "the first `size` tasks; null = all")
    timeout_s: float = setting(60, "seconds per scoring and per tool call")
    max_steps: int = setting(1, "more than 1 gives the model the task's tools")
    system_prompt: str | None = setting(None, "the system prompt; null = the task's own")
    success: str | None = setting(None, "the reward that says solved; null = the heaviest")


@register_task("verifiers", settings=VerifiersSettings)
def build_verifiers_task(s: VerifiersSettings) -> Task:
    """The verifiers task."""
    import importlib.util

    if importlib.util.find_spec("verifiers") is None:
        raise ConfigError(f"env.dataset=verifiers: the verifiers package is not installed; {INSTALL}")
    if not s.id:
        raise ConfigError(f"env.id={s.id!r}: name the verifiers environment (its taskset package), e.g. "
                          "env.id=my_env")
    if s.size is not None and s.size < 1:
        raise ConfigError(f"env.size={s.size!r}: must be an integer >= 1, or null for every task")
    if s.timeout_s <= 0:
        raise ConfigError(f"env.timeout_s={s.timeout_s!r}: must be a number of seconds > 0")
    tasks = _load_tasks(s.id, dict((s.taskset or {}).items()), s.size)
    weights, metric_names = _check_task(s.id, tasks[0])
    reward_names = list(weights)
    success = max(reward_names, key=weights.get) if s.success is None else s.success
    if success not in reward_names:
        raise ConfigError(f"env.success={success!r}: not one of the task's rewards ({', '.join(reward_names)})")
    env = VerifiersEnv(tasks, float(s.timeout_s))
    tools = None
    if s.max_steps > 1 and type(tasks[0]).toolsets(tasks[0].config):
        try:
            tools = _tool_prompt(env.toolbox(0).schemas)
        except Exception as err:
            raise ConfigError(f"env.id={s.id}: starting its tool servers failed ({one_line(err)})") from None
    env.prompts = [_prompt(t, s.system_prompt, tools) for t in tasks]
    names = [*reward_names, *metric_names]
    return VerifiersTask(
        name=f"verifiers:{s.id}", rows=datasets.Dataset.from_dict(_columns(tasks)), system_prompt=None,
        rewards=[Reward(n, _component_fn(env, n, len(names)), weights.get(n, 0.0)) for n in names],
        success=success, env=env)
