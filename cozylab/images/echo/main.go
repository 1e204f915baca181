// echo: the real-node lab's backend Pod (cozylab/realnode/), a static binary with nothing but
// the standard library, in an image of its own (scripts/build-node.sh).
//
//	echo serve             HTTP on :80 (/ names the pod, /ready answers 200 while ready,
//	                       /bytes?n=N sends N bytes), a TCP echo and a UDP echo on :7
//	echo ready on|off      switch /ready of the server in this pod (the readiness probe's path)
//	echo dial tcp|udp ADDR MESSAGE
//	                       send MESSAGE to ADDR from this pod and print the answer (the lab's
//	                       server answers with the source address it saw: the pod's egress)
package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"
)

var ready atomic.Bool

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	switch os.Args[1] {
	case "serve":
		serve()
	case "ready":
		if len(os.Args) != 3 || (os.Args[2] != "on" && os.Args[2] != "off") {
			usage()
		}
		setReady(os.Args[2])
	case "dial":
		if len(os.Args) != 5 {
			usage()
		}
		dial(os.Args[2], os.Args[3], os.Args[4])
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: echo serve | echo ready on|off | echo dial tcp|udp ADDR MESSAGE")
	os.Exit(2)
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "echo: "+format+"\n", args...)
	os.Exit(1)
}

func serve() {
	ready.Store(true)
	name, _ := os.Hostname()
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s %s\n", name, r.RemoteAddr)
	})
	mux.HandleFunc("/ready", func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost:
			ready.Store(r.URL.Query().Get("set") == "on")
			fmt.Fprintf(w, "ready %v\n", ready.Load())
		case ready.Load():
			fmt.Fprintln(w, "ready")
		default:
			http.Error(w, "not ready", http.StatusServiceUnavailable)
		}
	})
	mux.HandleFunc("/bytes", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(r.URL.Query().Get("n"))
		if err != nil || n < 0 {
			http.Error(w, "n: a number of bytes", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(n))
		chunk := make([]byte, 32*1024)
		for n > 0 {
			k := min(n, len(chunk))
			if _, err := w.Write(chunk[:k]); err != nil {
				return
			}
			n -= k
		}
	})
	tcp, err := net.Listen("tcp", ":7")
	if err != nil {
		fail("tcp :7: %v", err)
	}
	udp, err := net.ListenPacket("udp", ":7")
	if err != nil {
		fail("udp :7: %v", err)
	}
	go func() {
		for {
			c, err := tcp.Accept()
			if err != nil {
				fail("tcp accept: %v", err)
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := udp.ReadFrom(buf)
			if err != nil {
				fail("udp read: %v", err)
			}
			_, _ = udp.WriteTo(buf[:n], from)
		}
	}()
	fmt.Printf("echo: serving HTTP :80, TCP and UDP echo :7 as %s\n", name)
	if err := http.ListenAndServe(":80", mux); err != nil {
		fail("http :80: %v", err)
	}
}

func setReady(state string) {
	resp, err := http.Post("http://127.0.0.1:80/ready?set="+state, "text/plain", nil)
	if err != nil {
		fail("%v", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(os.Stdout, resp.Body)
}

func dial(network, addr, message string) {
	if network != "tcp" && network != "udp" {
		usage()
	}
	c, err := net.DialTimeout(network, addr, 5*time.Second)
	if err != nil {
		fail("%v", err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(message + "\n")); err != nil {
		fail("%v", err)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		fail("no answer from %s: %v", addr, err)
	}
	fmt.Print(line)
}
