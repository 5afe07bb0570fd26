"""What the REST API (``api/``) and the dashboard (``dashboard/``) share, so that neither imports
the other: the running services and the routes' dependencies (``deps``), who is asking
(``auth``), the outer guard (``middleware``) and the parameters both take (``params``). The app
that mounts both is ``evalsvc/app.py``."""
