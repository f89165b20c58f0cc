import sys

from k3serve.cli import main

sys.exit(main())
