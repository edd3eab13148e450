"""Routes (thin): parse, call the domain service, render."""

from fastapi import APIRouter

router = APIRouter()
