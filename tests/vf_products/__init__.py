"""A small verifiers (v1) environment for the tests: "What is a * b?" with a calculator tool server. Its task
pays `correct` (weight 1) for the product in the last reply, `brief` (weight 0.5) for a reply under 40
characters, `used_calculator` (weight 0.25) for a tool result in the episode, and records a `turns` metric.
Tasks whose `a` is `raise_on` make `correct` raise; those whose `a` is `hang_on`, never return."""
import asyncio

import verifiers.v1 as vf


class ProductData(vf.TaskData):
    answer: str
    a: int


class Calculator(vf.Toolset):
    @vf.tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


class ProductTaskConfig(vf.TaskConfig):
    calculator: vf.ToolsetConfig = vf.ToolsetConfig()
    raise_on: int = -1
    hang_on: int = -1


class ProductTask(vf.Task[ProductData, vf.State, ProductTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(config.calculator)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.a == self.config.raise_on:
            raise RuntimeError("no product for this one")
        if self.data.a == self.config.hang_on:
            await asyncio.sleep(3600)
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) < 40)

    @vf.reward(weight=0.25)
    async def used_calculator(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class ProductsConfig(vf.TasksetConfig):
    num_tasks: int = 8
    first: int = 12
    task: ProductTaskConfig = ProductTaskConfig()


class ProductsTaskset(vf.Taskset[ProductTask, ProductsConfig]):
    def load(self):
        for a in range(self.config.first, self.config.first + self.config.num_tasks):
            yield ProductTask(ProductData(prompt=f"What is {a} * 34?", answer=str(a * 34), a=a,
                                          system_prompt="Answer with the number."), self.config.task)


__all__ = ["ProductsTaskset"]
