"""Readers and writers for schedule and plan file formats."""
