"""Bubble planning: the pure planner and the per-job profiles and plans that feed it."""

from bubblesnap.service.bubbles.planner import PlannerOptions
from bubblesnap.service.bubbles.plans import BubbleOptions, BubblePlans

__all__ = ["BubbleOptions", "BubblePlans", "PlannerOptions"]
