"""SGLang glue: the plugin entry point and the server flags (imports SGLang)."""
