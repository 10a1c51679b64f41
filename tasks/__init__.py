"""The worker side: Celery task, heartbeat, file checks and the job kinds (diffusers calls)."""
