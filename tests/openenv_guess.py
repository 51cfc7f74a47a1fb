"""A small OpenEnv text game served on localhost for the tests: ``python openenv_guess.py PORT``.

Guess the number: ``reset(seed)`` thinks of a digit (``seed % 10``) and asks for it; each ``step`` reads the
first digit of the action's ``message``: right scores 1 and ends the episode, wrong scores 0 and answers
"Higher." or "Lower.", and the third wrong guess ends it. A message ``hang`` makes the step sleep a minute and
``crash`` makes it raise: the faults a real server has, on demand.
"""
import sys
import time

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class GuessNumber(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.target = State(episode_id="", step_count=0), 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target = (seed or 0) % 10
        self._state = State(episode_id=episode_id or str(seed), step_count=0)
        return GuessObservation(prompt="I am thinking of a digit from 0 to 9. Guess it: reply with one digit.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.message.strip() == "hang":
            time.sleep(60)
        if action.message.strip() == "crash":
            raise RuntimeError("the game crashed")
        digits = [int(c) for c in action.message if c.isdigit()]
        if digits and digits[0] == self.target:
            return GuessObservation(prompt="Right!", reward=1.0, done=True)
        done = self._state.step_count >= 3
        hint = "No digit." if not digits else ("Higher." if digits[0] < self.target else "Lower.")
        return GuessObservation(prompt=hint, reward=0.0, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(GuessNumber, GuessAction, GuessObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
