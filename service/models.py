"""Every domain's models, imported in one place so Alembic (and `Base.metadata`) sees all tables."""

from __future__ import annotations

from service.checkpoints import models as checkpoints_models
from service.datasets import models as datasets_models
from service.environments import models as environments_models
from service.evaluations import models as evaluations_models
from service.jobs import models as jobs_models
from service.kit.db import Base
from service.primitives import models as primitives_models
from service.quotas import models as quotas_models
from service.rewards import models as rewards_models
from service.tenants import models as tenants_models
from service.usage import models as usage_models
from service.webhooks import models as webhooks_models

__all__ = [
    "Base",
    "checkpoints_models",
    "datasets_models",
    "environments_models",
    "evaluations_models",
    "jobs_models",
    "primitives_models",
    "quotas_models",
    "rewards_models",
    "tenants_models",
    "usage_models",
    "webhooks_models",
]
