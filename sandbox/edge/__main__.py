"""``python -m sandbox.edge``: the edge service of one host (:func:`sandbox.edge.app.main`)."""

from sandbox.edge.app import main

raise SystemExit(main())
