"""mpipe_verified: pipeline-parallel schedules as algebra terms, lowered, verified by Z3."""

__version__ = "0.1.0"
