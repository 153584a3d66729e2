"""A "trainer" for the echo model: counts the words of its training text."""

import time

from cog import BaseModel, Input


class TrainingOutput(BaseModel):
    words: int
    vocabulary: int


def train(
    text: str = Input(description="Training text"),
    epochs: int = Input(description="Passes over the text", default=1, ge=1, le=100),
    delay: float = Input(description="Seconds each epoch takes", default=0.0, ge=0.0, le=10.0),
) -> TrainingOutput:
    words = text.split()
    for epoch in range(epochs):
        time.sleep(delay)
        print(f"epoch {epoch + 1}/{epochs}: {len(words)} words")
    return TrainingOutput(words=len(words) * epochs, vocabulary=len(set(words)))
