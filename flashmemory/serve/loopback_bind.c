/* An LD_PRELOAD shim that keeps a process's every-interface listeners on loopback.
 *
 * It wraps libc's bind(): an IPv4 bind to INADDR_ANY (0.0.0.0) becomes 127.0.0.1; an IPv6 bind to in6addr_any
 * (::) becomes ::ffff:127.0.0.1 on a dual-stack socket (IPV6_V6ONLY off: it accepted IPv4 clients before and
 * still accepts those on this machine) or ::1 on an IPv6-only one. The port, flow info and scope are kept, and
 * every other bind (a specific address, AF_UNIX, netlink, ...) goes to libc unchanged.
 *
 * Why: a library that binds every interface whatever address it is told (Mooncake's transfer engine: its
 * RPC/handshake port on 0.0.0.0, its TCP data port on ::) cannot be moved by a setting; the launch scripts
 * preload this into a server only when its stack is local-only (HOST on loopback, no --dist-init-addr).
 * Built by flashmemory/serve/loopback.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind;

__attribute__((constructor)) static void find_real_bind(void) { real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind"); }

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    if (!real_bind) find_real_bind();
    if (!real_bind) {
        errno = ENOSYS;
        return -1;
    }
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            int v6only = 1;
            socklen_t n = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &n) != 0) v6only = 1;
            if (v6only) {
                a.sin6_addr = in6addr_loopback;
            } else {
                static const unsigned char mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
                memcpy(&a.sin6_addr, mapped, sizeof mapped);
            }
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
