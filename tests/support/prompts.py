"""Prompts for the bundled model: short ones of several kinds and languages, and one over
500 tokens."""

LONG_TEXT = " ".join(
    f"Section {i}: the river town kept records of every flood, every harvest and every "
    f"market day, and the archivist number {i} wrote them down in a careful hand."
    for i in range(20)
)

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "def fibonacci(n):\n    ",
    "请用中文介绍一下长城的历史。",
    "人工智能的未来是",
    "Once upon a time, in a land far away,",
    "Q: What is 12 times 7?\nA:",
    "import torch\nimport torch.nn as nn\n\nclass MLP(nn.Module):",
    "The three primary colors are",
    "Translate to French: 'Good morning, how are you?'\n",
    LONG_TEXT + "\nSummarize the records above in one sentence:",
]
