"""Test fixtures that real SGLang servers can load: small seeded hybrid GDN / KDA checkpoints."""
