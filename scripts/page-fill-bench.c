// How fast fresh anonymous memory fills from a file in the page cache: 4 KiB faults against
// MADV_HUGEPAGE, on 1..N threads. What CRIU's restorer does per task (preadv into new mappings).
//
//   gcc -O2 -static -pthread scripts/page-fill-bench.c -o page-fill-bench
//   head -c 3000000000 /dev/urandom > /tmp/f; cat /tmp/f > /dev/null
//   ./page-fill-bench /tmp/f HUGE(0|1) THREADS
// Results: docs/benchmarks/NOTES.md, "Session 6: CRIU's page restore".
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <pthread.h>
#include <time.h>
static int fd; static char *mem; static size_t len; static int nthr;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
static void *worker(void *a){ long i=(long)a; size_t chunk=len/nthr; size_t off=i*chunk; size_t end=off+chunk;
  while(off<end){ size_t n= end-off > (64<<20) ? (64<<20) : end-off; ssize_t r=pread(fd,mem+off,n,off); if(r<=0){perror("pread");exit(1);} off+=r;} return 0;}
int main(int argc,char**argv){ fd=open(argv[1],O_RDONLY); len=lseek(fd,0,SEEK_END); int huge=atoi(argv[2]); nthr=atoi(argv[3]);
  mem=mmap(0,len+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  mem=(char*)(((unsigned long)mem+(2<<20)-1)&~((2UL<<20)-1));
  if(huge) madvise(mem,len,MADV_HUGEPAGE);
  double t0=now(); pthread_t th[64]; for(long i=0;i<nthr;i++) pthread_create(&th[i],0,worker,(void*)i); for(int i=0;i<nthr;i++) pthread_join(th[i],0);
  double t=now()-t0; printf("huge=%d threads=%d %.2f GB in %.3f s = %.2f GB/s\n",huge,nthr,len/1e9,t,len/1e9/t); return 0;}
