"""The edge's routes, one module per concern; each has ``setup(ctx, app)`` and reaches the service
only through the :class:`~sandbox.edge.context.EdgeContext` it is given.  Only
:mod:`sandbox.edge.app` imports these modules."""
