"""Cassandra schema (versioned CQL migrations in cql/) and message schemas (json/)."""

from pathlib import Path

CQL_DIR = Path(__file__).resolve().parent / "cql"
JSON_DIR = Path(__file__).resolve().parent / "json"
