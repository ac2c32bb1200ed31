"""A tiny third-party Twinkle plugin (test fixture): a loss and a task, registered lazily."""
