"""The strata-desk dashboard (Textual): `tui.app.run_dashboard` is the entry point; see docs/dashboard.md."""
