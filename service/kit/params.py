"""Annotated request-parameter types shared by the routes (see contract.fields for the rules)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from contract.fields import Text

# A resource id in the path: compared with stored ids, so it must be text the database can hold.
PathId = Annotated[Text, Path()]
# The `after` cursor of the lists whose ids are strings (newest first).
Cursor = Annotated[Text | None, Query(max_length=64, description="`next_after` of the previous page.")]
