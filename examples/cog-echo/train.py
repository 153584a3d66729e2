"""A "trainer" for the echo model: counts the words of its training text."""

from cog import BaseModel, Input


class TrainingOutput(BaseModel):
    words: int
    vocabulary: int


def train(
    text: str = Input(description="Training text"),
    epochs: int = Input(description="Passes over the text", default=1, ge=1, le=100),
) -> TrainingOutput:
    words = text.split()
    for epoch in range(epochs):
        print(f"epoch {epoch + 1}/{epochs}: {len(words)} words")
    return TrainingOutput(words=len(words) * epochs, vocabulary=len(set(words)))
