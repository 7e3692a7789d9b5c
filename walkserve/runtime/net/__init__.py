"""Beyond one host: authenticated TCP control (``auth``), workers that join from another host
(``remote``), cross-host link estimates (``link``) and the Mooncake data path (``mooncake``)."""
