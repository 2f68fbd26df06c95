#!/bin/sh
# Guest-side Docker check, run as PID 1 (init=/docker-check) in a rootfs that
# has dockerd, containerd, runc and iptables (e.g. debootstrap bookworm with
# docker.io) plus a static busybox at /opt/busybox. It prints "DOCK ..." lines
# on the console: dockerd ready, import, run, cgroup limits, bridge, DNAT of a
# published port. Used by hand to prove kernel-config; see README.md here.
#   cp scripts/tcg/guest-docker-check.sh ROOT/docker-check; cp /bin/busybox ROOT/opt/busybox
#   mkfs.ext4 -q -F -d ROOT -b 4096 -m 0 root.ext4   (after truncate -s 1200M root.ext4)
#   scripts/tcg/boot.sh --kernel vmlinux --rootfs root.ext4 --vsock-uds /tmp/d/vsock \
#       --append init=/docker-check --wait 400
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs tmpfs /run; mount -t tmpfs tmpfs /tmp
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
ip link set lo up
echo "DOCK init uptime=$(cut -d' ' -f1 /proc/uptime)"
dockerd --debug 2>&1 | sed "s/^/dockerd: /" > /dev/console &
i=0; while [ ! -S /run/docker.sock ]; do sleep 1; i=$((i+1)); [ $i -gt 400 ] && break; [ $((i % 20)) = 0 ] && echo "DOCK waiting $i s; $(ps -e -o comm= 2>/dev/null | tr '\n' ' ')"; done
echo "DOCK socket uptime=$(cut -d' ' -f1 /proc/uptime)"
docker version
echo "DOCK ready uptime=$(cut -d' ' -f1 /proc/uptime)"
docker info 2>&1 | grep -E 'Cgroup|Storage Driver|WARNING|Kernel'
mkdir -p /tmp/img; cp /opt/busybox /tmp/img/busybox
tar -C /tmp/img -c . | docker import - bb >/dev/null && echo "DOCK import ok"
docker run --rm bb /busybox echo hello-from-container && echo "DOCK run ok uptime=$(cut -d' ' -f1 /proc/uptime)"
docker run --rm -m 64m --pids-limit 50 --cpus 0.5 bb /busybox sh -c 'cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max /sys/fs/cgroup/cpu.max' && echo "DOCK limits ok"
docker run --rm bb /busybox ip -4 addr show eth0 | grep inet && echo "DOCK bridge ok"
docker run -d --name web -p 8080:80 bb /busybox httpd -f -p 80 -h / >/dev/null && sleep 2
cip=$(docker inspect -f '{{.NetworkSettings.IPAddress}}' web)
/opt/busybox wget -q -O /dev/null "http://$cip:80/busybox" && echo "DOCK container-ip http ok"
/opt/busybox wget -q -O /dev/null http://127.0.0.1:8080/busybox && echo "DOCK published-port http ok"
iptables -t nat -S | head -20
docker rm -f web >/dev/null
echo "DOCK done uptime=$(cut -d' ' -f1 /proc/uptime)"
/opt/busybox reboot -f
