/*
 * vsock-echo: a line echo over AF_VSOCK (guest side) and over the host-side
 * Unix sockets of a vsock device that speaks the "CONNECT <port>\n" protocol
 * (rollbox-vmm, Firecracker, vhost-device-vsock). Used by scripts/tcg/smoke.sh.
 *
 * Guest:
 *   vsock-echo listen PORT [COUNT]        echo lines on each of COUNT connections (0 = forever)
 *   vsock-echo connect CID PORT MESSAGE   send MESSAGE, expect it echoed back
 * Host:
 *   vsock-echo unix-listen PATH [COUNT]   echo lines on a Unix socket (guest-initiated
 *                                         connections to host port P arrive on <uds>_P)
 *   vsock-echo unix-connect UDS PORT MESSAGE
 *                                         "CONNECT PORT\n", expect "OK ...\n", then as connect
 *
 * Exit status 0 on success; errors name the failing call and its input.
 * Build: gcc -O2 -static -o vsock-echo vsock-echo.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/vm_sockets.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define LINE_MAX_BYTES 4096

static int fail(const char *what, const char *input)
{
	fprintf(stderr, "vsock-echo: %s (%s): %s\n", what, input, strerror(errno));
	return 1;
}

static int parse_uint(const char *text, const char *name, unsigned long *out)
{
	char *end = NULL;

	errno = 0;
	*out = strtoul(text, &end, 10);
	if (errno != 0 || end == text || *end != '\0') {
		fprintf(stderr, "vsock-echo: %s must be a non-negative integer, got '%s'\n", name, text);
		return -1;
	}
	return 0;
}

static int write_all(int fd, const char *buf, size_t len)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		buf += n;
		len -= (size_t)n;
	}
	return 0;
}

/* Reads one '\n'-terminated line (newline kept) into buf; returns its length,
 * 0 on EOF before any byte, -1 on error or overlong line. Reads a byte at a
 * time so nothing after the newline is consumed. */
static ssize_t read_line(int fd, char *buf, size_t cap)
{
	size_t len = 0;

	while (len + 1 < cap) {
		ssize_t n = read(fd, buf + len, 1);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		if (n == 0)
			break;
		len++;
		if (buf[len - 1] == '\n')
			break;
	}
	if (len + 1 >= cap) {
		errno = EMSGSIZE;
		return -1;
	}
	buf[len] = '\0';
	return (ssize_t)len;
}

static void echo_lines(int fd)
{
	char line[LINE_MAX_BYTES];
	ssize_t len;

	while ((len = read_line(fd, line, sizeof(line))) > 0) {
		if (write_all(fd, line, (size_t)len) != 0)
			break;
	}
}

static int serve(int listener, unsigned long count, const char *where)
{
	unsigned long served = 0;

	if (listen(listener, 16) != 0)
		return fail("listen", where);
	printf("vsock-echo: listening on %s\n", where);
	fflush(stdout);
	while (count == 0 || served < count) {
		int conn = accept(listener, NULL, NULL);
		if (conn < 0) {
			if (errno == EINTR)
				continue;
			return fail("accept", where);
		}
		echo_lines(conn);
		close(conn);
		served++;
		printf("vsock-echo: served connection %lu on %s\n", served, where);
		fflush(stdout);
	}
	close(listener);
	return 0;
}

/* Sends MESSAGE plus a newline and checks that the same line comes back. */
static int exchange(int fd, const char *message, const char *where)
{
	char expected[LINE_MAX_BYTES];
	char reply[LINE_MAX_BYTES];
	ssize_t len;
	int wanted = snprintf(expected, sizeof(expected), "%s\n", message);

	if (wanted < 0 || (size_t)wanted >= sizeof(expected)) {
		fprintf(stderr, "vsock-echo: message too long (%zu bytes)\n", strlen(message));
		return 1;
	}
	if (write_all(fd, expected, (size_t)wanted) != 0)
		return fail("write", where);
	len = read_line(fd, reply, sizeof(reply));
	if (len < 0)
		return fail("read reply", where);
	if (strcmp(reply, expected) != 0) {
		fprintf(stderr, "vsock-echo: %s echoed '%.*s', expected '%s'\n", where,
			(int)len, reply, message);
		return 1;
	}
	printf("vsock-echo: echo ok via %s: %s\n", where, message);
	return 0;
}

static int cmd_listen(int argc, char **argv)
{
	unsigned long port, count = 0;
	struct sockaddr_vm addr;
	int fd;

	if (argc < 3 || argc > 4 || parse_uint(argv[2], "PORT", &port) != 0 ||
	    (argc == 4 && parse_uint(argv[3], "COUNT", &count) != 0))
		return 2;
	fd = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (fd < 0)
		return fail("socket(AF_VSOCK)", argv[2]);
	memset(&addr, 0, sizeof(addr));
	addr.svm_family = AF_VSOCK;
	addr.svm_cid = VMADDR_CID_ANY;
	addr.svm_port = (unsigned int)port;
	if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
		return fail("bind vsock port", argv[2]);
	return serve(fd, count, "vsock");
}

static int cmd_connect(int argc, char **argv)
{
	unsigned long cid, port;
	struct sockaddr_vm addr;
	char where[64];
	int fd, rc;

	if (argc != 5 || parse_uint(argv[2], "CID", &cid) != 0 ||
	    parse_uint(argv[3], "PORT", &port) != 0)
		return 2;
	snprintf(where, sizeof(where), "vsock cid %lu port %lu", cid, port);
	fd = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (fd < 0)
		return fail("socket(AF_VSOCK)", where);
	memset(&addr, 0, sizeof(addr));
	addr.svm_family = AF_VSOCK;
	addr.svm_cid = (unsigned int)cid;
	addr.svm_port = (unsigned int)port;
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
		return fail("connect", where);
	rc = exchange(fd, argv[4], where);
	close(fd);
	return rc;
}

static int unix_socket_at(const char *path, struct sockaddr_un *addr)
{
	int fd;

	if (strlen(path) >= sizeof(addr->sun_path)) {
		fprintf(stderr, "vsock-echo: socket path too long: %s\n", path);
		return -1;
	}
	memset(addr, 0, sizeof(*addr));
	addr->sun_family = AF_UNIX;
	strcpy(addr->sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM, 0);
	if (fd < 0)
		fail("socket(AF_UNIX)", path);
	return fd;
}

static int cmd_unix_listen(int argc, char **argv)
{
	struct sockaddr_un addr;
	unsigned long count = 0;
	int fd;

	if (argc < 3 || argc > 4 || (argc == 4 && parse_uint(argv[3], "COUNT", &count) != 0))
		return 2;
	fd = unix_socket_at(argv[2], &addr);
	if (fd < 0)
		return 1;
	if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
		return fail("bind", argv[2]);
	return serve(fd, count, argv[2]);
}

static int cmd_unix_connect(int argc, char **argv)
{
	struct sockaddr_un addr;
	char request[32], reply[LINE_MAX_BYTES];
	unsigned long port;
	ssize_t len;
	int fd, rc;

	if (argc != 5 || parse_uint(argv[3], "PORT", &port) != 0)
		return 2;
	fd = unix_socket_at(argv[2], &addr);
	if (fd < 0)
		return 1;
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
		return fail("connect", argv[2]);
	snprintf(request, sizeof(request), "CONNECT %lu\n", port);
	if (write_all(fd, request, strlen(request)) != 0)
		return fail("write CONNECT", argv[2]);
	len = read_line(fd, reply, sizeof(reply));
	if (len < 0)
		return fail("read CONNECT reply", argv[2]);
	if (strncmp(reply, "OK ", 3) != 0) {
		fprintf(stderr, "vsock-echo: %s answered '%.*s' to CONNECT %lu, expected 'OK ...'\n",
			argv[2], (int)len, reply, port);
		return 1;
	}
	rc = exchange(fd, argv[4], argv[2]);
	close(fd);
	return rc;
}

int main(int argc, char **argv)
{
	int rc = 2;

	/* A peer that goes away mid-echo must not kill the listener. */
	signal(SIGPIPE, SIG_IGN);
	if (argc >= 2 && strcmp(argv[1], "listen") == 0)
		rc = cmd_listen(argc, argv);
	else if (argc >= 2 && strcmp(argv[1], "connect") == 0)
		rc = cmd_connect(argc, argv);
	else if (argc >= 2 && strcmp(argv[1], "unix-listen") == 0)
		rc = cmd_unix_listen(argc, argv);
	else if (argc >= 2 && strcmp(argv[1], "unix-connect") == 0)
		rc = cmd_unix_connect(argc, argv);
	if (rc == 2)
		fprintf(stderr,
			"usage: vsock-echo listen PORT [COUNT] | connect CID PORT MESSAGE |\n"
			"       unix-listen PATH [COUNT] | unix-connect UDS PORT MESSAGE\n");
	return rc;
}
