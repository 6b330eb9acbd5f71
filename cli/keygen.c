/* keygen.c — `bdfp4 keygen PREFIX`: a CURVE key pair for the router, a worker or a client
 * (base/bd_zsec.h): PREFIX.key the secret key (mode 0600, never overwritten), PREFIX.pub the
 * public key, which goes into the peer's configuration or allow-list. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "base/bd_zsec.h"
#include "cli.h"

static void usage(FILE *f)
{
	fprintf(f, "usage: bdfp4 keygen [OPTIONS] PREFIX\n"
		   "\n"
		   "Make a CURVE key pair (ZeroMQ's Curve25519) for an encrypted, authenticated TCP\n"
		   "endpoint: PREFIX.key holds the secret key (mode 0600; an existing file is never\n"
		   "overwritten), PREFIX.pub the public key. A server's .pub goes to its clients\n"
		   "(--server-key, router_server_key); a client's .pub goes into the server's\n"
		   "allow-list (curve_clients, curve_workers), one key a line. The public key is\n"
		   "printed on stdout.\n"
		   "\n"
		   "  -h, --help   this text\n");
}

int cmd_keygen(int argc, char **argv)
{
	static const struct option opts[] = {
		CLI_OPTS_END,
	};
	struct bd_zsec_keypair kp;
	char err[512];
	int c, e;

	optind = 0;
	opterr = 0;
	while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1)
		return cli_getopt_other("keygen", usage, c, argv);
	if (optind != argc - 1)
		return cli_bad_usage("keygen", usage, "%s", "one PREFIX, please");
	e = bd_zsec_keygen(argv[optind], &kp, err, sizeof(err));
	if (e < 0) {
		fprintf(stderr, "bdfp4 keygen: %s\n", err);
		return 1;
	}
	printf("%s\n", kp.pub);
	memset(&kp, 0, sizeof(kp));
	return 0;
}
