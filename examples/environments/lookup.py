"""A TRL-style environment class (`environment_factory` contract), served over OpenEnv by `grpo envs serve`:

    grpo envs serve examples.environments.lookup:CapitalLookup --port 8011

The policy is asked for a country's capital; it may `lookup` the country in a table, then `answer`. The episode's
reward (`get_reward`) is 1.0 once the answer is the row's, else 0.0.
"""

from __future__ import annotations

CAPITALS = {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi", "peru": "Lima", "canada": "Ottawa"}


class CapitalLookup:
    def __init__(self) -> None:
        self.expected = ""
        self.answered = ""

    def reset(self, **row: str) -> str:
        self.expected, self.answered = row.get("answer", ""), ""
        return f"What is the capital of {row.get('country', '?')}?"

    def lookup(self, country: str) -> str:
        """Look a country up in the table of capitals."""
        return CAPITALS.get(country.strip().lower(), "unknown country")

    def answer(self, city: str) -> str:
        """Give the final answer."""
        self.answered = city.strip()
        return "recorded"

    def get_reward(self) -> float:
        return 1.0 if self.answered and self.answered == self.expected else 0.0
