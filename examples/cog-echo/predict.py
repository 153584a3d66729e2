"""An echo "language model": streams the prompt back word by word.

It stands in for a real model in Hangar's compatibility test of the `cog`
engine: `setup()` loads a "vocabulary", `predict()` streams its output as
an `Iterator[str]` (as Replicate's language models do) and logs as it goes.
"""

import time
from typing import Iterator

from cog import BasePredictor, Input


class Predictor(BasePredictor):
    def setup(self) -> None:
        print("setup: loading the echo model")
        self.prefix = "echo:"

    def predict(
        self,
        prompt: str = Input(description="Text to echo back"),
        repeat: int = Input(description="Times to echo the prompt", default=1, ge=1, le=10),
        delay: float = Input(description="Seconds between words", default=0.0, ge=0.0, le=10.0),
    ) -> Iterator[str]:
        print(f"predicting {len(prompt)} characters, {repeat} time(s)")
        words = [self.prefix] + prompt.split() * repeat
        for i, word in enumerate(words):
            if delay and i > 0:
                time.sleep(delay)
            yield word + " "
        print("done")
