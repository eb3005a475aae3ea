"""Managed module hooks: registration by name, per-module dispatch, backward hooks, pytrees."""
