"""The app's screens: dashboard, first run, settings, bench, logs, help and the modals."""
